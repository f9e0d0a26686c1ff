"""Pages run again when the toolkit module changes.

Sphinx-Gallery re-runs a tutorial only when its own file changes (an MD5 of
the source, ``auto_tutorials/<stem>.py.md5``). Every page also imports
``tutorials/ragged_toolkit.py``, so a change there must re-run them too.
Before Sphinx-Gallery runs, the module's MD5 is compared with the one
recorded at the previous build (``auto_tutorials/ragged_toolkit.md5``); when
they differ, every page's MD5 record is removed, so each page runs again.
Where nothing was recorded yet (a new gallery, or one merged from shards that
ran with this very module) the MD5 is recorded and nothing is removed.
"""

from __future__ import annotations

from pathlib import Path

from gallery_layout import GALLERY_OUT, GALLERY_SRC, TOOLKIT, tutorial_sources

RECORD = TOOLKIT.removesuffix(".py") + ".md5"


def toolkit_md5(src_dir: Path) -> str:
    from sphinx_gallery.utils import get_md5sum

    return get_md5sum(Path(src_dir) / GALLERY_SRC / TOOLKIT, mode="t")


def invalidate_pages(src_dir: Path) -> list[str]:
    """Remove the pages' MD5 records if the toolkit changed since they ran;
    returns the tutorials made to run again."""
    src_dir = Path(src_dir)
    if not (src_dir / GALLERY_SRC / TOOLKIT).exists():
        return []
    gallery = src_dir / GALLERY_OUT
    record, current = gallery / RECORD, toolkit_md5(src_dir)
    stale = []
    if record.exists() and record.read_text().strip() != current:
        for src in tutorial_sources(src_dir):
            md5 = gallery / f"{src.name}.md5"
            if md5.exists():
                md5.unlink()
                stale.append(src.name)
    gallery.mkdir(parents=True, exist_ok=True)
    record.write_text(current)
    return stale


def on_builder_inited(app) -> None:
    for name in invalidate_pages(Path(app.srcdir)):
        print(f"toolkit_cache: {TOOLKIT} changed, {name} runs again")


def setup(app):
    app.connect("builder-inited", on_builder_inited, priority=310)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
