"""The first cell of every downloaded notebook.

It installs a package only when it is missing or older than the oldest
release the tutorials support, so on Colab, or any machine with a newer
PyTorch, it downloads nothing. The minimums are read from
``requirements-minimum.txt``, the one place they are written.
"""

from __future__ import annotations

import re
from pathlib import Path

TEMPLATE = '''\
# Install what this notebook needs, but only what is missing or older than the
# oldest release it supports: a newer PyTorch is kept as it is.
import importlib.metadata
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
print("installed:" if _needed else "nothing to install:",
      ", ".join(f"{{n}} {{importlib.metadata.version(n)}}" for n, _ in {minimums!r}))'''


def minimums(path: Path) -> list[tuple[str, str]]:
    """(package, minimum version) from a requirements file of ``name>=version`` lines."""
    found = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][\w.]*)", line)
        if m is None:
            raise ValueError(f"{path}: expected 'name>=version', got {line!r}")
        found.append((m.group(1), m.group(2)))
    return found


def install_cell(path: Path) -> str:
    return TEMPLATE.format(minimums=minimums(path))
