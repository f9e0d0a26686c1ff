"""Generated pages whose tutorial is gone are removed before the build.

Sphinx-Gallery writes ``auto_tutorials/<stem>.rst`` (and its ``.py``,
``.ipynb``, caches and images) for every tutorial, and never removes them. A
renamed or deleted tutorial would leave a page no toctree includes, which
the strict build rejects. Before Sphinx-Gallery runs, every file there that
belongs to a tutorial with no source any more is deleted; files of existing
tutorials (the cache of pages that ``GALLERY_PATTERN`` does not select) are
kept.
"""

from __future__ import annotations

import re
from pathlib import Path

GALLERY_SRC = "tutorials"
GALLERY_OUT = "auto_tutorials"
KEEP = {"index", "sg_execution_times"}


def is_image_of(name: str, stem: str) -> bool:
    """Whether ``name`` is an image Sphinx-Gallery wrote for the tutorial
    ``stem``: ``sphx_glr_<stem>_<NNN>[_<srcset>].<ext>`` or
    ``sphx_glr_<stem>_thumb.<ext>``. Exact, so ``attn`` does not claim the
    images of ``attn_gqa``."""
    return re.fullmatch(rf"sphx_glr_{re.escape(stem)}_(?:thumb|\d{{3}}(?:_\d+_\d+x)?)\.\w+", name) is not None


def stale_files(src_dir: Path) -> list[Path]:
    gallery = src_dir / GALLERY_OUT
    if not gallery.is_dir():
        return []
    sources = {p.stem for p in (src_dir / GALLERY_SRC).glob("*.py")}
    found = [p for p in gallery.iterdir()
             if p.is_file() and p.name.split(".")[0] not in sources | KEEP]
    images = gallery / "images"
    if images.is_dir():
        found += [p for p in images.rglob("sphx_glr_*")
                  if p.is_file() and not any(is_image_of(p.name, s) for s in sources)]
    return sorted(found)


def remove_stale(app) -> None:
    """``builder-inited``, before Sphinx-Gallery."""
    for path in stale_files(Path(app.srcdir)):
        path.unlink()


def setup(app):
    app.connect("builder-inited", remove_stale, priority=300)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
