"""Where the tutorials are, their reading order, and which generated files
are whose: the one place for these (``conf.py``, the extensions and
``scripts/`` read it; standard library only, for the GPU workflow's plan and
merge jobs). Before Sphinx-Gallery runs, it deletes the files of tutorials
that are gone and, when the toolkit changed, the pages' MD5 records, so that
every page runs again."""

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
    other = folder != GALLERY_OUT or "/" in stem or stem == "index" or stem.startswith("sg_execution")
    return None if other else stem


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


def clean_gallery(app) -> None:
    """``builder-inited``, before Sphinx-Gallery: no file of a tutorial that is
    gone (a page no toctree includes fails the strict build); every page runs
    again when the toolkit changed since the MD5 recorded beside them (none
    yet, as in a gallery merged from shards: record it)."""
    src_dir, gallery = Path(app.srcdir), Path(app.srcdir) / GALLERY_OUT
    gallery.mkdir(parents=True, exist_ok=True)
    keep = {"index", "sg_execution_times", TOOLKIT_MD5.split(".")[0]}
    generated = {p for p in gallery.iterdir() if p.is_file() and p.name.split(".")[0] not in keep}
    generated |= {p for p in gallery.glob("images/**/sphx_glr_*") if p.is_file()}
    for path in generated - {p for src in tutorial_sources(src_dir) for p in tutorial_files(gallery, src.stem)}:
        path.unlink()
    toolkit, record = src_dir / GALLERY_SRC / TOOLKIT, gallery / TOOLKIT_MD5
    if toolkit.exists():  # hashed as Sphinx-Gallery hashes a source: text, any line ending
        current = hashlib.md5(toolkit.read_text(encoding="utf-8").encode("utf-8")).hexdigest()
        if record.exists() and record.read_text().strip() != current:
            for md5 in gallery.glob("*.py.md5"):
                md5.unlink()
                print(f"gallery_layout: {TOOLKIT} changed, {md5.name.removesuffix('.md5')} runs again")
        record.write_text(current)


def setup(app):
    app.connect("builder-inited", clean_gallery, priority=300)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
