"""Where the tutorials are, their reading order, and which generated files
belong to which one.

The one place for the folder names, the toolkit's file name and
:data:`READING_ORDER` (``conf.py``, the extensions and ``scripts/`` read
them). As an extension, before Sphinx-Gallery runs, it deletes the generated
files of tutorials that are gone (a renamed page would leave a page no
toctree includes) and, when the toolkit changed since the last build, the
pages' MD5 records, so that every page runs again. Standard library only:
the GPU workflow's plan and merge jobs import it without installing anything.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

GALLERY_SRC = "tutorials"  # the sources
GALLERY_OUT = "auto_tutorials"  # what Sphinx-Gallery generates from them
TOOLKIT = "ragged_toolkit.py"  # the module every page imports; not a page (``ignore_pattern``)
TOOLKIT_MD5 = TOOLKIT.removesuffix(".py") + ".md5"  # in GALLERY_OUT: the toolkit the pages ran with
# A page not listed comes after the listed ones, by name; a listed name with no file is ignored.
READING_ORDER = [
    "ragged_batches_intro",
    "transformer_building_blocks",
    "transformer_layers_for_ragged_batches",
    "packed_gpt_training",
    "hf_packed_training",
    "data_parallel_packed_training",
    "ragged_decoding_kv_cache_gqa",
    "which_attention_path",
]


def reading_order_key(stem: str) -> tuple[int, str]:
    return (READING_ORDER.index(stem), "") if stem in READING_ORDER else (len(READING_ORDER), stem)


class TutorialOrder:
    """Sphinx-Gallery's ``within_subsection_order``: :data:`READING_ORDER`."""

    def __init__(self, src_dir):
        self.src_dir = src_dir

    def __repr__(self):  # a stable repr keeps Sphinx's pickled config stable
        return "gallery_layout.TutorialOrder"

    def __call__(self, filename):
        return reading_order_key(Path(filename).stem)


def tutorial_sources(src_dir: Path) -> list[Path]:
    """The tutorial scripts: every ``.py`` in the sources but the toolkit."""
    return sorted(p for p in (Path(src_dir) / GALLERY_SRC).glob("*.py") if p.name != TOOLKIT)


def tutorial_stem(docname: str) -> str | None:
    """The tutorial a Sphinx document is the page of, or None."""
    folder, _, stem = docname.partition("/")
    if folder != GALLERY_OUT or "/" in stem or stem == "index" or stem.startswith("sg_execution"):
        return None
    return stem


def is_image_of(name: str, stem: str) -> bool:
    """Whether ``name`` is an image Sphinx-Gallery wrote for ``stem`` (exactly:
    ``attn`` never claims the images of ``attn_gqa``)."""
    return re.fullmatch(rf"sphx_glr_{re.escape(stem)}_(?:thumb|\d{{3}}(?:_\d+_\d+x)?)\.\w+", name) is not None


def tutorial_files(gallery: Path, stem: str) -> list[Path]:
    """Every file in ``gallery`` (an ``auto_tutorials/``) written for the
    tutorial ``stem``: its page, script, notebook, caches, stamp and images."""
    gallery = Path(gallery)
    files = [p for p in gallery.iterdir() if p.is_file() and p.name.split(".")[0] == stem]
    if (gallery / "images").is_dir():
        files += [p for p in (gallery / "images").rglob("sphx_glr_*") if p.is_file() and is_image_of(p.name, stem)]
    return sorted(files)


def stale_files(src_dir: Path) -> list[Path]:
    """Generated files that belong to no current tutorial."""
    gallery = Path(src_dir) / GALLERY_OUT
    if not gallery.is_dir():
        return []
    keep = {"index", "sg_execution_times", TOOLKIT_MD5.split(".")[0]}
    generated = {p for p in gallery.iterdir() if p.is_file() and p.name.split(".")[0] not in keep}
    if (gallery / "images").is_dir():
        generated |= {p for p in (gallery / "images").rglob("sphx_glr_*") if p.is_file()}
    live = {p for src in tutorial_sources(src_dir) for p in tutorial_files(gallery, src.stem)}
    return sorted(generated - live)


def invalidate_pages(src_dir: Path) -> list[str]:
    """Remove the pages' MD5 records if the toolkit changed since they ran
    (nothing recorded yet, as in a gallery merged from shards: record it);
    returns the tutorials made to run again."""
    src_dir, stale = Path(src_dir), []
    toolkit = src_dir / GALLERY_SRC / TOOLKIT
    if not toolkit.exists():
        return stale
    gallery = src_dir / GALLERY_OUT
    record = gallery / TOOLKIT_MD5
    # As Sphinx-Gallery hashes a source (get_md5sum, mode "t"): text, any line ending.
    current = hashlib.md5(toolkit.read_text(encoding="utf-8").encode("utf-8")).hexdigest()
    if record.exists() and record.read_text().strip() != current:
        for src in tutorial_sources(src_dir):
            md5 = gallery / f"{src.name}.md5"
            if md5.exists():
                md5.unlink()
                stale.append(src.name)
    gallery.mkdir(parents=True, exist_ok=True)
    record.write_text(current)
    return stale


def clean_gallery(app) -> None:
    """``builder-inited``, before Sphinx-Gallery."""
    for path in stale_files(Path(app.srcdir)):
        path.unlink()
    for name in invalidate_pages(Path(app.srcdir)):
        print(f"gallery_layout: {TOOLKIT} changed, {name} runs again")


def setup(app):
    app.connect("builder-inited", clean_gallery, priority=300)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
