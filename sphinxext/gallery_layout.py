"""Where the tutorials are, and which generated files belong to which one.

The one place for the two folder names (``conf.py``, the extensions,
``scripts/shards.py`` and ``scripts/validate_build.py`` read them) and for
the rule that says which of the files Sphinx-Gallery writes belong to a
tutorial: exactly, so that ``attn`` never claims the files of ``attn_gqa``.
Standard library only: the GPU workflow's plan and merge jobs import it
without installing anything.
"""

from __future__ import annotations

import re
from pathlib import Path

GALLERY_SRC = "tutorials"  # the sources
GALLERY_OUT = "auto_tutorials"  # what Sphinx-Gallery generates from them
# The module beside the tutorials that every page imports: not a page itself
# (Sphinx-Gallery's ``ignore_pattern`` skips it).
TOOLKIT = "ragged_toolkit.py"


def tutorial_sources(src_dir: Path) -> list[Path]:
    """The tutorial scripts: every ``.py`` in the sources but the toolkit."""
    return sorted(p for p in (Path(src_dir) / GALLERY_SRC).glob("*.py") if p.name != TOOLKIT)


def tutorial_stem(docname: str) -> str | None:
    """The tutorial a Sphinx document is the page of, or None."""
    prefix = GALLERY_OUT + "/"
    if not docname.startswith(prefix):
        return None
    stem = docname[len(prefix):]
    if "/" in stem or stem == "index" or stem.startswith("sg_execution"):
        return None
    return stem


def is_image_of(name: str, stem: str) -> bool:
    """Whether ``name`` is an image Sphinx-Gallery wrote for ``stem``:
    ``sphx_glr_<stem>_<NNN>[_<srcset>].<ext>`` or ``sphx_glr_<stem>_thumb.<ext>``."""
    return re.fullmatch(rf"sphx_glr_{re.escape(stem)}_(?:thumb|\d{{3}}(?:_\d+_\d+x)?)\.\w+", name) is not None


def tutorial_files(gallery: Path, stem: str) -> list[Path]:
    """Every file in ``gallery`` (an ``auto_tutorials/`` folder) that
    Sphinx-Gallery or this build wrote for the tutorial ``stem``: its page,
    script, notebook, caches, stamp and images."""
    gallery = Path(gallery)
    files = [p for p in gallery.iterdir() if p.is_file() and p.name.split(".")[0] == stem]
    images = gallery / "images"
    if images.is_dir():
        files += [p for p in images.rglob("sphx_glr_*") if p.is_file() and is_image_of(p.name, stem)]
    return sorted(files)
