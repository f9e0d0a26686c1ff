"""The first cell of every downloaded notebook, and a page's own extra one.

The first cell installs a package only when it is missing or older than the
oldest release the tutorials support, so on Colab, or any machine with a
newer PyTorch, it downloads nothing. The minimums are read from
``requirements-minimum.txt``, the one place they are written.

A package that only some pages need is written there too, tagged with the
pages that need it (``transformers>=4.54.0  # page: hf_packed_training``):
it stays out of the first cell, and the notebooks of those pages get one
more cell, right after the one that writes the toolkit
(:func:`page_install_cell`, placed by ``downloads.py``), which installs it
the same way and prints only when it installed something.
"""

from __future__ import annotations

import re
from pathlib import Path

# What both cells run: install each (name, minimum) of {minimums!r} that is
# missing or older; then {report} prints what is installed.
_INSTALL = '''import importlib.metadata
import re
import subprocess
import sys


def _version(text):
    return tuple(int(n) for n in re.findall(r"\\d+", text.split("+")[0])[:3])


_needed = []
for _name, _minimum in {minimums!r}:
    try:
        _installed = importlib.metadata.version(_name)
    except importlib.metadata.PackageNotFoundError:
        _installed = None
    if _installed is None or _version(_installed) < _version(_minimum):
        _needed.append(f"{{_name}}>={{_minimum}}")
if _needed:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", *_needed])
{report}'''

_VERSIONS = '", ".join(f"{{n}} {{importlib.metadata.version(n)}}" for n, _ in {minimums!r})'

TEMPLATE = ("# Install what this notebook needs, but only what is missing or older than the\n"
            "# oldest release it supports: a newer PyTorch is kept as it is.\n"
            + _INSTALL.replace("{report}", 'print("installed:" if _needed else "nothing to install:",\n'
                                          "      " + _VERSIONS + ")"))

# The first line of a page's extra install cell: how downloads.py finds one.
PAGE_CELL_HEAD = "# This page also needs"

# (prints only when it installed something)
PAGE_TEMPLATE = (PAGE_CELL_HEAD + " {needs}: installed only where missing or older.\n"
                 + _INSTALL.replace("{report}", '    print("installed:", ' + _VERSIONS + ")"))

_PAGES = re.compile(r"#\s*pages?:\s*([\w\s,]+?)\s*$")


def _requirements(path: Path) -> list[tuple[str, str, tuple[str, ...]]]:
    """(package, minimum version, the pages that alone need it, or ()) from a
    requirements file of ``name>=version`` lines, each optionally followed by
    ``# page: stem`` (or ``# pages: a, b``)."""
    found = []
    for raw in path.read_text().splitlines():
        line, _, comment = raw.partition("#")
        line = line.strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][\w.]*)", line)
        if m is None:
            raise ValueError(f"{path}: expected 'name>=version', got {line!r}")
        tag = _PAGES.search("#" + comment) if comment else None
        pages = tuple(p for p in re.split(r"[\s,]+", tag.group(1)) if p) if tag else ()
        found.append((m.group(1), m.group(2), pages))
    return found


def minimums(path: Path) -> list[tuple[str, str]]:
    """(package, minimum version) that every page needs: the lines of
    ``path`` that name no page."""
    return [(name, version) for name, version, pages in _requirements(path) if not pages]


def page_minimums(path: Path, stem: str) -> list[tuple[str, str]]:
    """(package, minimum version) that the page ``stem`` needs beyond
    :func:`minimums`: the lines of ``path`` tagged with it."""
    return [(name, version) for name, version, pages in _requirements(path) if stem in pages]


def install_cell(path: Path) -> str:
    return TEMPLATE.format(minimums=minimums(path))


def page_install_cell(path: Path, stem: str) -> str | None:
    """The source of the page's extra install cell, or None where it needs
    nothing beyond the first cell."""
    extra = page_minimums(path, stem)
    if not extra:
        return None
    needs = ", ".join(f"{name} {version} or later" for name, version in extra)
    return PAGE_TEMPLATE.format(needs=needs, minimums=extra)
