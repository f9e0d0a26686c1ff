"""Each page's size and how much of its code is measuring, as issue 32
counts it: the code lines that time, bound, tabulate or print figures, over
the page's code lines (comments, docstrings and blank lines left out).

A top-level statement counts as measuring, all its lines, when it uses a
name imported from the toolkit's measuring modules (``measure``,
``choose``, ``work_bound``, ``StepTimer``, ...) or a name that an earlier
measuring statement assigned (timings, their tables, their plots), or
prints a figure (a ``print`` whose text names ms, tokens/s, a speedup, a
bound, an IQR, a fraction or a median). Standard library only::

    python scripts/page_metrics.py [PAGE.py ...] [--json]
"""

from __future__ import annotations

import ast
import io
import json
import re
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MEASURING = ("ragged_site.measuring",)
FIGURE_WORDS = re.compile(r"\bms\b|tokens/s|speedup|bound|IQR|fraction|median|MiB|per second", re.I)


def code_lines(source: str) -> set[int]:
    """Lines holding code: not blank, not only a comment, not a docstring."""
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    tree = ast.parse(source)
    for node in ast.walk(tree):  # docstrings are prose
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            lines -= set(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def measuring_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(MEASURING):
            names |= {a.asname or a.name for a in node.names}
    return names


def measures(node: ast.stmt, names: set[str], source: str) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in names:
            return True
        if isinstance(sub, ast.Call) and getattr(sub.func, "id", "") == "print":
            if FIGURE_WORDS.search(ast.get_source_segment(source, sub) or ""):
                return True
    return False


def page_metrics(path: Path) -> dict:
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    code = code_lines(source)
    names = measuring_names(tree)
    counted = set()
    for node in tree.body:
        if measures(node, names, source):
            counted |= set(range(node.lineno, node.end_lineno + 1)) & code
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):  # what it assigns is a figure
                names |= {t.id for sub in ast.walk(node) if isinstance(sub, (ast.Assign, ast.AugAssign,
                          ast.AnnAssign, ast.For, ast.With, ast.comprehension))
                          for t in ast.walk(getattr(sub, "target", None) or ast.Tuple(
                              elts=[*getattr(sub, "targets", [])], ctx=ast.Store())) if isinstance(t, ast.Name)}
                names |= {n.optional_vars.id for sub in ast.walk(node) if isinstance(sub, ast.With)
                          for n in sub.items if isinstance(n.optional_vars, ast.Name)}
    return {"page": path.stem, "source_lines": len(source.splitlines()), "code_lines": len(code),
            "measuring_lines": len(counted), "measuring_share": round(len(counted) / max(len(code), 1), 3)}


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv if not a.startswith("--")] or sorted((REPO / "tutorials").glob("*.py"))
    rows = [page_metrics(p) for p in paths]
    if "--json" in argv:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'page':40s} {'lines':>6s} {'code':>6s} {'measuring':>10s} {'share':>6s}")
    for r in rows:
        print(f"{r['page']:40s} {r['source_lines']:6d} {r['code_lines']:6d} {r['measuring_lines']:10d} "
              f"{r['measuring_share']:6.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
