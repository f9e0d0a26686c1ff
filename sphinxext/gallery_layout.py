"""Where the tutorials are, their reading order, which generated files are
whose, and which toolkit modules each page uses: the one place for these
(``conf.py``, the extensions and ``scripts/`` read it; standard library only,
for the GPU workflow's plan and merge jobs). Before Sphinx-Gallery runs, it
deletes the files of tutorials that are gone and, for each toolkit module
that changed, the MD5 records of the pages that import it, directly or
through other modules, so that those pages run again and no other."""

from __future__ import annotations

import ast
import hashlib
import json
import re
from pathlib import Path

GALLERY_SRC = "tutorials"  # the sources
GALLERY_OUT = "auto_tutorials"  # what Sphinx-Gallery generates from them
TOOLKIT = "ragged_toolkit"  # the library every page imports, beside conf.py (pyproject.toml)
HARNESS = "ragged_site"  # the site's machinery the pages import, beside it (not in pyproject.toml)
PACKAGES = (TOOLKIT, HARNESS)  # the packages whose modules the pages run and their downloads carry
TOOLKIT_MD5 = TOOLKIT + ".md5.json"  # in GALLERY_OUT: each module's MD5 when the pages last ran
# A page not listed comes after the listed ones, by name; a listed name with no file is ignored.
# The reading order, in tracks: a new page joins one. The landing page lists
# them numbered, and each page shows them with its own place marked.
TRACKS = {
    "Foundations": [
        "ragged_batches_intro",
        "transformer_building_blocks",
        "packed_attention_layer",
        "measuring_ragged_batches",
        "transformer_layers_for_ragged_batches",
    ],
    "Training": [
        "ragged_transformer_training",
        "packed_gpt_training",
        "hf_packed_training",
        "data_parallel_packed_training",
        "packed_recurrent_layers",
        "packed_hybrid_model",
    ],
    "Serving": [
        "ragged_decoding_kv_cache_gqa",
        "serving_continuous_batching",
        "serving_shared_prompts",
        "which_attention_path",
    ],
}
READING_ORDER = [stem for stems in TRACKS.values() for stem in stems]


def track_of(stem: str) -> tuple[str, int] | None:
    """The track a page is in and its place there (1 for the first), or None."""
    return next(((name, stems.index(stem) + 1) for name, stems in TRACKS.items() if stem in stems), None)


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
    """The tutorial scripts: every ``.py`` in the sources."""
    return sorted((Path(src_dir) / GALLERY_SRC).glob("*.py"))


# --- which toolkit modules a page uses ------------------------------------------

def toolkit_modules(src_dir: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the library and the harness
    (:data:`PACKAGES`) in ``src_dir`` (a package's ``__init__.py`` is the
    package's own name)."""
    found = {}
    for package in PACKAGES:
        root = Path(src_dir) / package
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_modules(path: Path, modules: dict[str, Path], name: str | None = None) -> set[str]:
    """The toolkit modules that ``path`` imports anywhere in it (``name``: its
    own dotted name, for relative imports), each with the packages above it,
    whose ``__init__`` runs first."""
    package = None if name is None else (name if path.name == "__init__.py" else name.rpartition(".")[0])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if package is None:
                    continue
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            if target in modules:
                parts = target.split(".")
                found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return found & set(modules)


def page_modules(page: Path, src_dir: Path) -> set[str]:
    """Every toolkit module that runs when ``page`` runs: those it imports,
    and, in turn, those they import."""
    modules = toolkit_modules(src_dir)
    todo, seen = list(imported_modules(page, modules)), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += imported_modules(modules[name], modules, name) - seen
    return seen


def _md5(path: Path) -> str:  # as Sphinx-Gallery hashes a source: text, any line ending
    return hashlib.md5(path.read_text(encoding="utf-8").encode("utf-8")).hexdigest()


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
    gone (a page no toctree includes fails the strict build); the pages that
    use a toolkit module changed since the MD5s recorded beside them run
    again, and only those (no record yet, as in a gallery merged from
    shards: record it)."""
    src_dir, gallery = Path(app.srcdir), Path(app.srcdir) / GALLERY_OUT
    gallery.mkdir(parents=True, exist_ok=True)
    keep = {"index", "sg_execution_times", TOOLKIT_MD5.split(".")[0]}
    generated = {p for p in gallery.iterdir() if p.is_file() and p.name.split(".")[0] not in keep}
    generated |= {p for p in gallery.glob("images/**/sphx_glr_*") if p.is_file()}
    for path in generated - {p for src in tutorial_sources(src_dir) for p in tutorial_files(gallery, src.stem)}:
        path.unlink()
    current = {name: _md5(path) for name, path in toolkit_modules(src_dir).items()}
    record = gallery / TOOLKIT_MD5
    if record.exists():
        before = json.loads(record.read_text())
        changed = {m for m in set(before) | set(current) if before.get(m) != current.get(m)}
        for page in tutorial_sources(src_dir):
            md5 = gallery / f"{page.name}.md5"
            uses = sorted(page_modules(page, src_dir) & changed)
            if uses and md5.exists():
                md5.unlink()
                print(f"gallery_layout: {', '.join(uses)} changed, {page.name} runs again")
    record.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")


def setup(app):
    app.connect("builder-inited", clean_gallery, priority=300)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
