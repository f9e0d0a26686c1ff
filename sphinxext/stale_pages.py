"""Generated pages whose tutorial is gone are removed before the build.

Sphinx-Gallery writes ``auto_tutorials/<stem>.rst`` (and its ``.py``,
``.ipynb``, caches and images) for every tutorial, and never removes them. A
renamed or deleted tutorial would leave a page no toctree includes, which
the strict build rejects. Before Sphinx-Gallery runs, every file there that
belongs to no current tutorial is deleted; files of existing tutorials (the
cache of pages that ``GALLERY_PATTERN`` does not select) are kept.
"""

from __future__ import annotations

from pathlib import Path

from gallery_layout import GALLERY_OUT, tutorial_files, tutorial_sources

KEEP = {"index", "sg_execution_times", "ragged_toolkit"}  # the gallery's own pages, the toolkit's MD5


def stale_files(src_dir: Path) -> list[Path]:
    gallery = Path(src_dir) / GALLERY_OUT
    if not gallery.is_dir():
        return []
    generated = [p for p in gallery.iterdir() if p.is_file() and p.name.split(".")[0] not in KEEP]
    if (gallery / "images").is_dir():
        generated += [p for p in (gallery / "images").rglob("sphx_glr_*") if p.is_file()]
    live = {p for src in tutorial_sources(src_dir) for p in tutorial_files(gallery, src.stem)}
    return sorted(set(generated) - live)


def remove_stale(app) -> None:
    """``builder-inited``, before Sphinx-Gallery."""
    for path in stale_files(Path(app.srcdir)):
        path.unlink()


def setup(app):
    app.connect("builder-inited", remove_stale, priority=300)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
