"""Keep the copies of shared definitions identical across the tutorials.

Every tutorial must run on its own when downloaded, so a page carries a copy
of each toolkit function it uses instead of importing a sibling file. This
script treats every top-level ``def`` and ``class`` (decorators included), and
every top-level assignment to a private name (``_KERNELS = ...``), that two or
more pages define as one definition with one original:

* the original is the building-blocks page's version when that page defines
  the name, else the version on the first page in reading order that does;
* every other page's copy must be the same text.

``python scripts/sync_toolkit.py`` lists the copies that differ (exit 1 if
any); ``--write`` replaces each differing copy with its original.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORIGIN = "transformer_building_blocks"  # the page that introduces the toolkit


@dataclass
class Definition:
    path: Path
    name: str
    start: int  # first line, 1-based, decorators included
    end: int  # last line, inclusive
    text: str


def definitions(path: Path) -> dict[str, Definition]:
    """The shareable top-level definitions of one tutorial, by name."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source, filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        elif (isinstance(node, (ast.Assign, ast.AnnAssign))
              and len(getattr(node, "targets", [getattr(node, "target", None)])) == 1):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if not (isinstance(target, ast.Name) and target.id.startswith("_")):
                continue
            name, start = target.id, node.lineno
        else:
            continue
        if name in found:
            raise ValueError(f"{path.relative_to(ROOT)}:{start}: {name!r} is defined twice on this page")
        found[name] = Definition(path, name, start, node.end_lineno,
                                 "\n".join(lines[start - 1:node.end_lineno]))
    return found


def reading_order(paths: list[Path]) -> list[Path]:
    sys.path.insert(0, str(ROOT / "sphinxext"))
    from gallery_order import reading_order_key  # noqa: PLC0415

    return sorted(paths, key=lambda p: reading_order_key(p.stem))


def differing(tutorials: Path) -> list[tuple[Definition, Definition]]:
    """(copy, original) for every copy whose text differs from its original."""
    pages = reading_order(sorted(tutorials.glob("*.py")))
    pages.sort(key=lambda p: p.stem != ORIGIN)  # the origin page first, then reading order
    originals: dict[str, Definition] = {}
    out = []
    for page in pages:
        for name, d in definitions(page).items():
            if name not in originals:
                originals[name] = d
            elif d.text != originals[name].text:
                out.append((d, originals[name]))
    return out


def write(pairs: list[tuple[Definition, Definition]]) -> None:
    by_page: dict[Path, list[tuple[Definition, Definition]]] = {}
    for copy, original in pairs:
        by_page.setdefault(copy.path, []).append((copy, original))
    for page, items in by_page.items():
        lines = page.read_text(encoding="utf-8").splitlines()
        for copy, original in sorted(items, key=lambda i: -i[0].start):  # bottom up
            lines[copy.start - 1:copy.end] = original.text.splitlines()
        page.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="replace each differing copy with its original")
    ap.add_argument("--tutorials", type=Path, default=ROOT / "tutorials")
    args = ap.parse_args(argv)
    pairs = differing(args.tutorials)
    if args.write:
        write(pairs)
        for copy, original in pairs:
            print(f"updated {copy.path.name}: {copy.name} (from {original.path.name})")
        return 0
    for copy, original in pairs:
        print(f"error: {copy.path.relative_to(ROOT)}:{copy.start}: {copy.name!r} differs from its "
              f"original in {original.path.relative_to(ROOT)}:{original.start} "
              f"(run: python scripts/sync_toolkit.py --write)", file=sys.stderr)
    return 1 if pairs else 0


if __name__ == "__main__":
    sys.exit(main())
