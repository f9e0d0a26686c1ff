"""List the code lines of the tutorials that are wider than a page's code column.

At a 1280 px window a code block on a tutorial page holds ``MAX_CHARS``
monospace characters without scrolling (measured in Chromium with the site's
CSS; ``tests/test_browser.py`` checks the rendered pages). A longer line is
clipped behind a scroll bar, so this script lists every one:

* on a tutorial page, every line of its code blocks, code comments and
  docstrings included (they are shown in the code blocks), but not the prose
  of its text blocks (the module docstring and the ``# %%`` comment blocks,
  rendered as paragraphs) and not what Sphinx-Gallery leaves out
  (``# sphinx_gallery_...`` config comments, ``start_ignore``/``end_ignore``
  blocks);
* in the toolkit's modules (``ragged_toolkit/``), every line: the pages show
  their functions whole, comments and docstrings included
  (``literalinclude`` with ``:pyobject:``).

``python scripts/line_widths.py [FILE ...]`` prints ``file:line: length``
for each line longer than ``MAX_CHARS`` (``--max N`` to choose another
limit) and exits 1 if there is any. ``from line_widths import MAX_CHARS``
gives the limit to other scripts and tests.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sphinxext"))
from gallery_layout import (GALLERY_SRC, PACKAGES, TOOLKIT, toolkit_modules, tutorial_sources)  # noqa: E402

# Monospace characters a code or output block holds at a 1280 px window:
# measured in Chromium, in DejaVu Sans Mono (as wide as the widest of the
# usual monospace fonts) at the site's 13 px (_static/site.css), 121.1
# characters, less a few pixels for a wider scroll bar than Chromium's.
MAX_CHARS = 120

_CONFIG_COMMENT = re.compile(r"^\s*#\s*sphinx_gallery_(?!start_ignore|end_ignore)\w+")
_START_IGNORE = re.compile(r"^\s*#\s*sphinx_gallery_start_ignore\s*$")
_END_IGNORE = re.compile(r"^\s*#\s*sphinx_gallery_end_ignore\s*$")


def page_code_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of each line of a tutorial that its page shows
    in a code block."""
    from sphinx_gallery.py_source_parser import split_code_and_text_blocks

    source = path.read_text().splitlines()
    _, blocks = split_code_and_text_blocks(str(path))
    shown = []
    for label, content, lineno in blocks:
        if label != "code":
            continue
        ignoring = False
        for i, text in enumerate(content.splitlines()):
            number = lineno + i
            # The block's lines are the file's, from its first line on.
            assert source[number - 1] == text, (path, number, text)
            if _START_IGNORE.match(text):
                ignoring = True
            elif _END_IGNORE.match(text):
                ignoring = False
            elif not ignoring and not _CONFIG_COMMENT.match(text):
                shown.append((number, text))
    return shown


def long_lines(path: Path, limit: int = MAX_CHARS) -> list[tuple[int, int]]:
    """``(line number, length)`` of each shown code line of ``path`` longer
    than ``limit``."""
    path = Path(path)
    toolkit = any(path.resolve().is_relative_to(ROOT / package) for package in PACKAGES)
    lines = list(enumerate(path.read_text().splitlines(), 1)) if toolkit else page_code_lines(path)
    return [(n, len(text.rstrip())) for n, text in lines if len(text.rstrip()) > limit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path,
                        help=f"default: {GALLERY_SRC}/*.py and {TOOLKIT}/ (the pages and the toolkit)")
    parser.add_argument("--max", type=int, default=MAX_CHARS,
                        help=f"the most characters a line may have (default {MAX_CHARS})")
    args = parser.parse_args(argv)
    files = args.files or [*tutorial_sources(ROOT), *toolkit_modules(ROOT).values()]
    found = 0
    for path in files:
        shown = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
        for number, length in long_lines(path, args.max):
            print(f"{shown}:{number}: {length}")
            found += 1
    if found:
        print(f"{found} code line(s) longer than {args.max} characters", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
