"""Check, after a build, that every tutorial really ran to the end.

Sphinx can report success for a gallery that is not whole: a tutorial that
calls ``sys.exit`` stops the build early, and one whose code never runs (all
of it in a function nobody calls) renders a page with no output. Upstream's
check for a page that "ran in 0 seconds" silently stopped matching when the
timing format changed; this one reads Sphinx-Gallery's own records instead:

* ``<stem>.py.md5``: written only after a tutorial ran without error; it must
  match the current source, or the current version never ran;
* ``<stem>.cost.json``: the run time of that run, which must be above zero;
* ``<stem>.rst``: must hold at least one output block (printed text or a
  figure): every tutorial on this site shows what its code did.

Exit status 1 and one line per problem, naming the tutorial file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# The hash Sphinx-Gallery itself writes (text mode: line endings do not count).
from sphinx_gallery.utils import get_md5sum

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sphinxext"))
from gallery_layout import GALLERY_OUT, GALLERY_SRC, tutorial_sources  # noqa: E402


def problems(src_dir: Path, pattern: str = "") -> list[str]:
    gallery = src_dir / GALLERY_OUT
    found = []
    sources = tutorial_sources(src_dir)
    if not sources:
        return [f"{src_dir / GALLERY_SRC}: no tutorials"]
    # Sphinx-Gallery matches filename_pattern against the file's path.
    selected = [src for src in sources if not pattern or re.search(pattern, str(src))]
    if not selected:
        return [f"GALLERY_PATTERN {pattern!r} matched no tutorial, so none was checked"]
    for src in selected:
        name = f"{GALLERY_SRC}/{src.name}"
        md5 = gallery / f"{src.name}.md5"
        if not md5.exists():
            found.append(f"{name}: never finished running (no {md5.name})")
            continue
        if md5.read_text().strip() != get_md5sum(src, mode="t"):
            found.append(f"{name}: its current version did not finish running (stale {md5.name})")
            continue
        cost = gallery / f"{src.stem}.cost.json"
        seconds = json.loads(cost.read_text()).get("time", 0) if cost.exists() else 0
        if not seconds > 0:
            found.append(f"{name}: no recorded run time")
        rst = (gallery / f"{src.stem}.rst").read_text()
        if "sphx-glr-script-out" not in rst and "image-sg::" not in rst:
            found.append(f"{name}: ran but showed nothing (no printed output, no figure): did its code run?")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src_dir", type=Path, nargs="?", default=Path("."))
    ap.add_argument("--pattern", default="", help="check only tutorials matching this regex")
    args = ap.parse_args(argv)
    found = problems(args.src_dir, args.pattern)
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    if not found:
        print("validate_build: every tutorial ran to the end and showed its output")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
