"""What a reader downloads reads as the page and runs on its own.

At ``builder-inited`` the toolkit package is made into a wheel
(:func:`build_wheel`, from ``pyproject.toml``), which every page links as
"Download the toolkit". At ``build-finished`` the copies of a page's
downloads in ``_build/html/_downloads/`` are rewritten from Sphinx-Gallery's
files (left as they are: it compares them with the sources): the notebook
opens with the page's title, then one short cell installs what is missing
or too old and the toolkit's wheel, and its links lead to the published
pages (:func:`notebook_for_download`); the ``.py`` is the page's own code,
with the toolkit modules it imports carried at its end
(:func:`carry_toolkit`); the zip holds both and the wheel, and runs offline.
Standard library only: the GPU build's merge job runs it without nbformat. The
Markdown of the notebooks is :mod:`rst_markdown`'s.
"""

from __future__ import annotations

import ast
import base64
import copy
import hashlib
import io
import json
import posixpath
import re
import tomllib
import zipfile
from pathlib import Path

from gallery_layout import (GALLERY_OUT, GALLERY_SRC, PACKAGES, TOOLKIT, page_modules,
                            toolkit_modules, tutorial_sources)
from rst_markdown import Include, Links, rst_to_markdown

# --- what the notebook installs -------------------------------------------------------

INSTALL_HEAD = "# What this notebook needs, installed only where it is missing or older than"


def requirements(path: Path) -> list[tuple[str, str, tuple[str, ...]]]:
    """(package, minimum, the pages that alone need it, or ()) from lines
    ``name>=version``, each optionally followed by ``# page: stem`` (``# pages: a, b``)."""
    found = []
    for raw in path.read_text().splitlines():
        line, _, comment = (part.strip() for part in raw.partition("#"))
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][\w.]*)", line)
        if m is None:
            raise ValueError(f"{path}: expected 'name>=version', got {line!r}")
        tag = re.fullmatch(r"pages?:\s*([\w\s,]+?)", comment)
        found.append((m[1], m[2], tuple(p for p in re.split(r"[\s,]+", tag[1]) if p) if tag else ()))
    return found


def minimums(path: Path, stem: str | None = None) -> list[tuple[str, str]]:
    """(package, minimum) that every page needs (the lines that name no
    page), and those that the page ``stem`` alone needs."""
    return [(name, version) for name, version, pages in requirements(path) if not pages or stem in pages]


def install_cell(path: Path, stem: str | None, wheel: str, wheel_url: str) -> str:
    """The notebook's install cell: the packages of ``requirements-minimum.txt``
    (``path``) that the page ``stem`` needs, each only where it is missing or
    older than its minimum (pip keeps a newer one), and the toolkit's
    ``wheel``: the file beside the notebook (the page's zip), else ``wheel_url``."""
    needs = " ".join(f'"{name}>={version}"' for name, version in minimums(path, stem))
    return (f"{INSTALL_HEAD} the oldest\n"
            "# release it supports, and the site's toolkit: the wheel beside this notebook\n"
            "# (in the page's zip), else the one on the site.\n"
            "import pathlib\n\n"
            f'toolkit = "{wheel}"\n'
            f'toolkit = toolkit if pathlib.Path(toolkit).exists() else "{wheel_url}"\n'
            f"%pip install --quiet {needs} {{toolkit}}")


# --- the toolkit as a wheel ----------------------------------------------------------

WHEEL_DIR = Path("_generated") / "wheel"  # in the sources: Sphinx copies a download from there


def toolkit_files(src_dir: Path, modules: set[str] | None = None) -> dict[str, str]:
    """Path in the package -> source of the toolkit's modules (``modules``:
    only those dotted names), in a stable order."""
    found = toolkit_modules(src_dir)
    return {path.relative_to(src_dir).as_posix(): path.read_text(encoding="utf-8")
            for name, path in found.items() if modules is None or name in modules}


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel_bytes(src_dir: Path) -> tuple[str, bytes]:
    """The toolkit as a wheel (its file name and bytes), from ``pyproject.toml``
    and the package's sources: version ``X.Y.Z+`` the sources' hash, so that a
    changed toolkit is a new version pip installs; the same bytes for the same
    sources."""
    project = tomllib.loads((Path(src_dir) / "pyproject.toml").read_text())["project"]
    files = {name: text.encode("utf-8") for name, text in toolkit_files(src_dir).items()}
    digest = hashlib.sha256(b"".join(n.encode() + b"\0" + d for n, d in files.items())).hexdigest()[:10]
    dist, version = project["name"].replace("-", "_"), f"{project['version']}+{digest}"
    info = f"{dist}-{version}.dist-info"
    metadata = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {version}",
                f"Summary: {project.get('description', '')}",
                f"Requires-Python: {project.get('requires-python', '>=3')}"]
    metadata += [f"Requires-Dist: {d}" for d in project.get("dependencies", [])]
    for extra, deps in project.get("optional-dependencies", {}).items():
        metadata += [f"Provides-Extra: {extra}"] + [f'Requires-Dist: {d}; extra == "{extra}"' for d in deps]
    files[f"{info}/METADATA"] = ("\n".join(metadata) + "\n").encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: the site's build (sphinxext/downloads.py)\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    record = [f"{n},{_record_hash(d)},{len(d)}" for n, d in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    return f"{dist}-{version}-py3-none-any.whl", zip_bytes(files)


def build_wheel(app) -> None:
    """``builder-inited``: the toolkit's wheel in ``_generated/wheel/``, the only
    file there (Sphinx copies it to the pages' downloads)."""
    src = Path(app.srcdir)
    if not (src / TOOLKIT).is_dir() or not (src / "pyproject.toml").exists():
        return
    name, data = wheel_bytes(src)
    folder = src / WHEEL_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        if old.name != name:
            old.unlink()
    if not (folder / name).exists() or (folder / name).read_bytes() != data:
        (folder / name).write_bytes(data)


def wheel_path(src_dir: Path) -> Path | None:
    """The wheel :func:`build_wheel` wrote, relative to the sources (None before)."""
    found = sorted((Path(src_dir) / WHEEL_DIR).glob("*.whl"))
    return found[0].relative_to(src_dir) if found else None


# --- the notebook and the .py ---------------------------------------------------------

def _code_cell(source: str, **metadata) -> dict:
    return {"cell_type": "code", "execution_count": None, "metadata": metadata, "outputs": [], "source": source}


def notebook_for_download(nb: dict, install: str, *, include: Include | None = None,
                          links: Links | None = None) -> dict:
    """Sphinx-Gallery's notebook as it is downloaded: the page's title and
    introduction, then the ``install`` cell, then the page, with no empty
    code cell and no rST. Applied to its own result it changes nothing."""
    nb, cells = copy.deepcopy(nb), []
    for cell in nb["cells"]:
        src = "".join(cell.get("source", ""))
        if cell["cell_type"] == "code" and (not src.strip() or src.startswith(INSTALL_HEAD)):
            continue
        if cell["cell_type"] == "markdown":
            cell["source"] = src = rst_to_markdown(src, include=include, links=links)
        if src.strip():
            cells.append(cell)
    cells.insert(1 if cells and cells[0]["cell_type"] == "markdown" else 0, _code_cell(install))
    nb["cells"] = cells
    return nb


def dump_notebook(nb: dict) -> str:
    return json.dumps(nb, indent=2, ensure_ascii=False) + "\n"


BEGIN = f"# --- {TOOLKIT}, carried: the toolkit modules this page imports ---"
END = "# --- End of the carried toolkit ---"
LOADER = ("# This script carries the toolkit modules it imports at its end, so that it runs\n"
          "# alone and offline; the next line unpacks them (the site's build added it).\n"
          f'exec(open(__file__, encoding="utf-8").read().rpartition({BEGIN + chr(10)!r})[2])\n')


def source_literal(source: str) -> str:
    """``source`` as a raw literal in ''' that evaluates back to it exactly."""
    if "'''" in source or "\r" in source or source.endswith(("'", "\\")):
        raise ValueError("a toolkit module holds ''' or a carriage return, or ends in ' or a backslash: it "
                         "cannot be carried in a raw string literal; write it without")
    return f"r'''{source}'''"


def toolkit_block(files: dict[str, str]) -> str:
    """The lines that unpack ``files`` (path -> source) into a temporary folder
    first on ``sys.path``, unless the toolkit was imported already."""
    entries = "".join(f"    {name!r}: {source_literal(text)},\n" for name, text in files.items())
    return f'''\
{BEGIN}
# The pages import the library {TOOLKIT} and the site's machinery {PACKAGES[1]}
# ("Download the toolkit" on each page gives both as a wheel to pip install).
# This block, written by the site's build, holds the modules this page imports;
# run, it writes them into a temporary folder, removed at exit, first on sys.path.
def _unpack_toolkit(files):
    import atexit
    import shutil
    import sys
    import tempfile
    from pathlib import Path

    if all(name.split("/")[0] in sys.modules for name in files):  # unpacked at the first import already
        return
    root = Path(tempfile.mkdtemp(prefix="{TOOLKIT}-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source, encoding="utf-8")
    sys.path.insert(0, str(root))


_unpack_toolkit({{
{entries}}})
{END}
'''


def carry_toolkit(script: str, files: dict[str, str]) -> str:
    """``script`` as the page wrote it, :func:`toolkit_block` of ``files`` at its
    end, and :data:`LOADER` just before its first import of the toolkit.
    Applied to its own result it replaces both instead of adding more."""
    script = script.replace(LOADER, "")
    script = re.sub(rf"\n*^{re.escape(BEGIN)}$.*?^{re.escape(END)}$\n?", "\n", script, flags=re.M | re.S)
    imports = [node.lineno for node in ast.parse(script).body if isinstance(node, (ast.Import, ast.ImportFrom))
               and any(n.split(".")[0] in PACKAGES
                       for n in ([node.module or ""] if isinstance(node, ast.ImportFrom)
                                 else [a.name for a in node.names]))]
    lines = script.splitlines(keepends=True)
    if imports:
        lines.insert(imports[0] - 1, LOADER)
    return "".join(lines).rstrip("\n") + "\n\n\n" + toolkit_block(files)


def zip_bytes(files: dict[str, str | bytes]) -> bytes:
    """A zip of ``name -> text or bytes``, the same bytes for the same files."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type, info.external_attr = zipfile.ZIP_DEFLATED, 0o644 << 16
            zf.writestr(info, data.encode("utf-8") if isinstance(data, str) else data)
    return buf.getvalue()


# --- Sphinx ------------------------------------------------------------------------------

def _links(app) -> Links:
    """The title and published URL of what a :doc:, :ref: or :term: names."""
    site, std, titles = app.config.tutorials_site_url, app.env.get_domain("std"), app.env.titles
    site = site if not site or site.endswith("/") else site + "/"
    terms = {name.lower(): entry for (kind, name), entry in std.objects.items() if kind == "term"}

    def url(doc, anchor=""):
        return f"{site}{doc}.html" + (f"#{anchor}" if anchor else "") if site else None

    def link(kind, target):
        if kind == "doc":
            doc = posixpath.normpath(target[1:] if target.startswith("/") else posixpath.join(GALLERY_OUT, target))
            return (titles[doc].astext() if doc in titles else None), (url(doc) if doc in app.env.all_docs else None)
        if kind == "term" and " ".join(target.lower().split()) in terms:
            doc, anchor = terms[" ".join(target.lower().split())][:2]
            return None, url(doc, anchor)
        if kind == "ref" and target.lower() in std.labels:
            doc, anchor, section = std.labels[target.lower()]
            return section or None, url(doc, anchor)
        if kind == "ref" and target.lower() in std.anonlabels:
            return None, url(*std.anonlabels[target.lower()])
        return None, None

    return link


def write_downloads(app, exc) -> None:
    """``build-finished``: the downloads of every tutorial, rewritten in the
    output from Sphinx-Gallery's files and the current toolkit."""
    src = Path(app.srcdir)
    gallery, minimums_txt, wheel = src / GALLERY_OUT, src / "requirements-minimum.txt", wheel_path(src)
    if exc is not None or not getattr(app.builder, "download_support", False) or wheel is None:
        return
    wheel_data = (src / wheel).read_bytes()
    wheel_url = f"{app.config.tutorials_site_url.rstrip('/')}/_downloads/{app.env.dlfiles[wheel][1]}" \
        if wheel in app.env.dlfiles else wheel.name
    links, stems = _links(app), {p.stem for p in tutorial_sources(src)}

    def include(rel):  # as Sphinx reads a literalinclude's path: "/..." from the sources
        return (src / rel[1:] if rel.startswith("/") else gallery / rel).resolve().read_text(encoding="utf-8")

    def downloads(stem):
        try:
            install = install_cell(minimums_txt, stem, wheel.name, wheel_url)
            nb = notebook_for_download(json.loads((gallery / f"{stem}.ipynb").read_text(encoding="utf-8")),
                                       install, include=include, links=links)
            carried = toolkit_files(src, page_modules(src / GALLERY_SRC / f"{stem}.py", src))
            py = carry_toolkit((gallery / f"{stem}.py").read_text(encoding="utf-8"), carried)
        except (LookupError, ValueError, OSError, SyntaxError) as err:
            from sphinx.errors import ExtensionError
            raise ExtensionError(f"{GALLERY_SRC}/{stem}.py: its downloads: {err}") from None
        files = {f"{stem}.py": py, f"{stem}.ipynb": dump_notebook(nb), wheel.name: wheel_data}
        return {".py": py.encode(), ".ipynb": files[f"{stem}.ipynb"].encode(), ".zip": zip_bytes(files)}

    made = {}
    for rel, (_docs, dest) in list(app.env.dlfiles.items()):
        rel, target = Path(rel), Path(app.outdir) / "_downloads" / str(dest)
        if rel.parent.as_posix() == GALLERY_OUT and rel.stem in stems and target.parent.is_dir() \
                and rel.suffix in (".py", ".ipynb", ".zip"):
            if rel.stem not in made:
                made[rel.stem] = downloads(rel.stem)
            if not target.exists() or target.read_bytes() != made[rel.stem][rel.suffix]:
                target.write_bytes(made[rel.stem][rel.suffix])


def setup(app):
    # Where the site is published: the notebooks' links and their toolkit lead there.
    app.add_config_value("tutorials_site_url", "", "html", types=[str])
    app.connect("builder-inited", build_wheel, priority=450)
    app.connect("build-finished", write_downloads)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
