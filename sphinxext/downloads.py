"""What a reader downloads runs on its own, in an empty folder.

At ``build-finished`` the copies of a page's downloads in
``_build/html/_downloads/`` are rewritten from Sphinx-Gallery's files (left
as they are: it compares them with the sources) and the current toolkit:
the ``.py`` defines ``ragged_toolkit`` from its source (:func:`carry_toolkit`);
the notebook installs what is missing or older than
``requirements-minimum.txt``, writes ``ragged_toolkit.py`` and has no rST
left (:func:`notebook_for_download`); the zip holds both and the module.
Standard library only: the GPU build's merge job runs it without nbformat.
"""

from __future__ import annotations

import ast
import copy
import io
import json
import posixpath
import re
import textwrap
import zipfile
from pathlib import Path
from typing import Callable

from gallery_layout import GALLERY_OUT, GALLERY_SRC, TOOLKIT, tutorial_sources

MODULE = TOOLKIT.removesuffix(".py")  # "ragged_toolkit"

# --- the rST the pages write -> Markdown ------------------------------------------
# Sphinx-Gallery converts headings, links, notes, math and code blocks at the
# start of a line. The rest that the pages use is converted here; anything
# else fails the build, naming the page and the word. ``include(path)`` reads
# what a literalinclude names; ``titles(target)`` the title of a :doc: target, or None.

Include = Callable[[str], str]
Titles = Callable[[str], "str | None"]

_DIRECTIVE = re.compile(  # a directive, or a comment (no name): not a target (.. _label:)
    r"^(?P<indent>[ \t]*)\.\.(?:[ \t]+(?P<name>[\w-]+)::[ \t]*(?P<arg>.*)|(?![ \t]+_)(?:[ \t].*)?)$")
_OPTION = re.compile(r"^:(?P<name>[\w-]+):(?:[ \t]+(?P<value>.*))?$")
_FENCE = re.compile(r"^[ \t]*(```|~~~)")
_ROLE = re.compile(r"(?<![\w`\\]):(?P<role>[a-z]+(?::[a-z]+)?):`(?P<content>[^`]+)`(?!`)")
_MANGLED_REF = re.compile(r"(?<![`\w:])`(?P<text>[^`<>]+?)\s*<(?P<label>[^`<>\s]+)>`(?![`_])")  # :ref: to SG
# Directives that show nothing on a page (or in a notebook).
NOTHING_TO_SHOW = {"currentmodule", "module", "index", "highlight", "contents", "toctree", "meta", "tags",
                   "sectionauthor", "codeauthor", "moduleauthor", "default-role"}
_EXPLICIT = re.compile(r"^(?P<text>.+?)\s*<(?P<target>[^<>]+)>$", re.S)


def _pyobject(source: str, name: str) -> str:
    """The source of the function or class ``name`` (``Class.method`` for a
    method) in ``source``, with its decorators, dedented."""
    node, body = None, ast.parse(source).body
    for part in name.split("."):
        node = next((n for n in body if getattr(n, "name", None) == part), None)
        if node is None:
            raise LookupError(f"no function or class {name!r} in the included file")
        body = node.body
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return textwrap.dedent("\n".join(source.splitlines()[start - 1:node.end_lineno]))


def _directive(name: str, arg: str, options: dict, body: list[str], include, titles) -> list[str]:
    convert = lambda lines: _blocks(lines, include, titles)  # noqa: E731
    if name in NOTHING_TO_SHOW:
        return []
    if name == "grid":
        return convert(body)
    if name == "grid-item-card":
        title = " ".join(re.sub(r":octicon:`[^`]*`", "", arg).split())
        return [f"**{title}**", ""] + convert(body)
    if name == "literalinclude":
        text = include(arg)
        text = _pyobject(text, options["pyobject"]) if "pyobject" in options else text
        return ["```python", *text.strip("\n").splitlines(), "```"]
    if name == "glossary":  # terms at the left edge, each definition indented below its terms
        out, terms, definition = [], [], []
        for line in body + ["(end)"]:
            if line.strip() and not line[0].isspace():  # a term
                if definition:
                    text = textwrap.dedent("\n".join(definition)).strip()
                    out += [", ".join(terms), "", *convert(text.split("\n")), ""]
                    terms, definition = [], []
                terms.append(f"**{line.strip()}**")
            else:
                definition.append(line)
        return out
    raise ValueError(f"'.. {name}::' has no Markdown form in the downloaded notebook: write it another "
                     "way, or teach sphinxext/downloads.py (_directive) to convert it")


def _blocks(lines: list[str], include: Include | None, titles: Titles | None) -> list[str]:
    """``lines`` with every directive converted and every rST comment dropped,
    code fences left alone, roles converted outside them."""
    out, i, fence, text = [], 0, None, []

    def flush():
        out.extend(_inline("\n".join(text), titles).split("\n") if text else [])
        text.clear()

    def indent(line):
        return len(line.expandtabs()) - len(line.expandtabs().lstrip())

    while i < len(lines):
        line, f = lines[i], _FENCE.match(lines[i])
        i += 1
        if fence or f:  # inside a code fence, or opening or closing one
            flush()
            out.append(line)
            fence = f.group(1) if fence is None else None if f and f.group(1) == fence else fence
            continue
        m = _DIRECTIVE.match(line)
        if not m:
            text.append(line)
            continue
        flush()
        start = i  # the directive's block: what is blank or indented deeper
        while i < len(lines) and (not lines[i].strip() or indent(lines[i]) > indent(line)):
            i += 1
        block = textwrap.dedent("\n".join(lines[start:i]).rstrip()).splitlines()
        if m["name"] is None:  # a comment
            continue
        options = {}
        while block and (o := _OPTION.match(block[0].strip())):
            options[o["name"]] = (o["value"] or "").strip()
            block = block[1:]
        while block and not block[0].strip():
            block = block[1:]
        rendered = _directive(m["name"], m["arg"].strip(), options, block, include, titles)
        if out and out[-1].strip():
            out.append("")
        out += [(m["indent"] + ln) if ln.strip() else "" for ln in rendered] + [""]
    flush()
    return out


def _role(kind: str, content: str, titles: Titles | None) -> str:
    kind, content = kind.split(":")[-1], " ".join(content.split())
    explicit = _EXPLICIT.match(content)
    text, target = (explicit["text"], explicit["target"]) if explicit else (None, content)
    if kind == "octicon":
        return ""
    if kind in ("ref", "doc", "term"):
        title = titles(target) if titles and kind == "doc" else None
        return f"*{text or title or (posixpath.basename(target) if kind == 'doc' else target)}*"
    raise ValueError(f"the role :{kind}: has no Markdown form in the downloaded notebook: write it another "
                     "way, or teach sphinxext/downloads.py (_role) to convert it")


def _inline(text: str, titles: Titles | None) -> str:
    text = _ROLE.sub(lambda m: _role(m["role"], m["content"], titles), text)
    return _MANGLED_REF.sub(lambda m: _role("ref", f"{m['text']} <{m['label']}>", titles), text)


def rst_to_markdown(text: str, *, include: Include | None = None, titles: Titles | None = None) -> str:
    """A markdown cell's text with the rST Sphinx-Gallery left in it converted."""
    result = re.sub(r"\n{3,}", "\n\n", "\n".join(_blocks(text.splitlines(), include, titles)))
    return result.strip("\n") + "\n" if result.strip() else ""


# --- the notebook's first cell: installs only what is missing or too old -------------

INSTALL_HEAD = "# Install what this notebook needs, but only what is missing or older than the"
_INSTALL = INSTALL_HEAD + '''
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


def install_cell(path: Path, stem: str | None = None) -> str:
    """The first cell of the notebook of ``stem`` (of every page: None)."""
    return _INSTALL.format(minimums=minimums(path, stem))


# --- the notebook and the .py ---------------------------------------------------------

WRITEFILE = f"%%writefile {TOOLKIT}"


def _code_cell(source: str, **metadata) -> dict:
    return {"cell_type": "code", "execution_count": None, "metadata": metadata, "outputs": [], "source": source}


def notebook_for_download(nb: dict, toolkit_source: str, *, install: str | None = None,
                          include: Include | None = None, titles: Titles | None = None) -> dict:
    """Sphinx-Gallery's notebook as it is downloaded: the install cell
    (``install``, else the one it has), the cell that writes the toolkit, then
    the page, with no empty code cell and no rST. Applied to its own result it
    changes nothing."""
    nb, cells = copy.deepcopy(nb), []
    for cell in nb["cells"]:
        src = "".join(cell.get("source", ""))
        if cell["cell_type"] == "code" and (not src.strip() or src.startswith(WRITEFILE)
                                            or (install and src.startswith(INSTALL_HEAD))):
            continue
        if cell["cell_type"] == "markdown":
            cell["source"] = src = rst_to_markdown(src, include=include, titles=titles)
        if src.strip():
            cells.append(cell)
    if install:
        cells.insert(0, _code_cell(install))
    at = 1 if cells and cells[0]["cell_type"] == "code" else 0  # after the install cell
    # Collapsed where the front end honours it: a thousand lines a reader runs, not reads.
    cells.insert(at, _code_cell(f"{WRITEFILE}\n{toolkit_source}", collapsed=False, jupyter={"source_hidden": True}))
    nb["cells"] = cells
    return nb


def dump_notebook(nb: dict) -> str:
    return json.dumps(nb, indent=2, ensure_ascii=False) + "\n"


BEGIN = f"# --- The site's toolkit module, {MODULE}, carried so that this script runs on its own"
END = "# --- End of the toolkit module"


def source_literal(source: str) -> str:
    """``source`` as a raw literal in ''' that evaluates back to it exactly."""
    if "'''" in source or "\r" in source or source.endswith(("'", "\\")):
        raise ValueError(f"{TOOLKIT} holds ''' or a carriage return, or ends in ' or a backslash: it cannot be "
                         "carried in a raw string literal; write it without")
    return f"r'''{source}'''"


def toolkit_block(toolkit_source: str) -> str:
    """The lines that define the module ``ragged_toolkit`` from its source."""
    return f'''\
{BEGIN}
# Every page of the site imports {MODULE} ("Download the toolkit" gives the
# file); this block, written by the site's build, defines it from its source.
import linecache as _linecache
import sys as _sys
import types as _types

_TOOLKIT_SOURCE = {source_literal(toolkit_source)}
_toolkit = _types.ModuleType({MODULE!r})
_toolkit.__file__ = {TOOLKIT!r}
_sys.modules[{MODULE!r}] = _toolkit  # before it runs: dataclasses look the module up
# Tracebacks and inspect show the toolkit's own lines (Python before 3.13
# prints an uncaught error's lines from files, not linecache: hence the hook).
_linecache.cache[{TOOLKIT!r}] = (len(_TOOLKIT_SOURCE), None, _TOOLKIT_SOURCE.splitlines(True), {TOOLKIT!r})
if _sys.version_info < (3, 13) and _sys.excepthook is _sys.__excepthook__:
    import traceback as _traceback

    _sys.excepthook = _traceback.print_exception
exec(compile(_TOOLKIT_SOURCE, {TOOLKIT!r}, "exec", dont_inherit=True), _toolkit.__dict__)
del _linecache, _sys, _types, _TOOLKIT_SOURCE, _toolkit
{END} {"-" * (len(BEGIN) - len(END) - 1)}
'''


def carry_toolkit(script: str, toolkit_source: str) -> str:
    """``script`` with :func:`toolkit_block` after its docstring and
    ``from __future__`` imports. Applied to its own result it replaces the
    block instead of adding a second one."""
    script = re.sub(rf"\n?^{re.escape(BEGIN)}.*?^{re.escape(END)}[^\n]*\n\n?", "\n", script, count=1,
                    flags=re.M | re.S)
    body, at = ast.parse(script).body, 0
    for k, node in enumerate(body):
        docstring = k == 0 and isinstance(node, ast.Expr) and isinstance(getattr(node.value, "value", None), str)
        if not (docstring or (isinstance(node, ast.ImportFrom) and node.module == "__future__")):
            break
        at = node.end_lineno
    lines = script.splitlines(keepends=True)
    head, tail = "".join(lines[:at]).rstrip("\n"), "".join(lines[at:]).lstrip("\n")
    block = toolkit_block(toolkit_source)
    return f"{head}\n\n{block}\n{tail}" if head else f"{block}\n{tail}"


def zip_bytes(files: dict[str, str]) -> bytes:
    """A zip of ``name -> text``, the same bytes for the same files."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in files.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type, info.external_attr = zipfile.ZIP_DEFLATED, 0o644 << 16
            zf.writestr(info, text.encode("utf-8"))
    return buf.getvalue()


# --- Sphinx ------------------------------------------------------------------------------

def _titles(app) -> Titles:
    """The title of the page a ``:doc:`` names (Sphinx-Gallery leaves no ``:ref:`` role)."""
    def title(target):
        doc = posixpath.normpath(target[1:] if target.startswith("/") else posixpath.join(GALLERY_OUT, target))
        return app.env.titles[doc].astext() if doc in app.env.titles else None

    return title


def write_downloads(app, exc) -> None:
    """``build-finished``: the downloads of every tutorial, rewritten in the
    output from Sphinx-Gallery's files and the current toolkit."""
    src = Path(app.srcdir)
    toolkit_path, gallery, minimums_txt = src / GALLERY_SRC / TOOLKIT, src / GALLERY_OUT, src / "requirements-minimum.txt"
    if exc is not None or not getattr(app.builder, "download_support", False) or not toolkit_path.exists():
        return
    toolkit, titles = toolkit_path.read_text(encoding="utf-8"), _titles(app)
    stems = {p.stem for p in tutorial_sources(src)}

    def include(rel):  # as Sphinx reads a literalinclude's path: "/..." from the sources
        return (src / rel[1:] if rel.startswith("/") else gallery / rel).resolve().read_text(encoding="utf-8")

    def downloads(stem):
        try:
            nb = notebook_for_download(json.loads((gallery / f"{stem}.ipynb").read_text(encoding="utf-8")), toolkit,
                                       install=install_cell(minimums_txt, stem) if minimums_txt.exists() else None,
                                       include=include, titles=titles)
            py = carry_toolkit((gallery / f"{stem}.py").read_text(encoding="utf-8"), toolkit)
        except (LookupError, ValueError, OSError) as err:
            from sphinx.errors import ExtensionError
            raise ExtensionError(f"{GALLERY_SRC}/{stem}.py: its downloads: {err}") from None
        files = {f"{stem}.py": py, f"{stem}.ipynb": dump_notebook(nb), TOOLKIT: toolkit}
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
    app.connect("build-finished", write_downloads)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
