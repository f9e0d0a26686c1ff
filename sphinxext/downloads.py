"""What a reader downloads runs on its own, in an empty folder.

Every tutorial imports the site's toolkit, ``tutorials/ragged_toolkit.py``.
Sphinx-Gallery's downloads of a page are its source as it is
(``auto_tutorials/<stem>.py``), a notebook made from it
(``auto_tutorials/<stem>.ipynb``) and a zip of the two: alone, none of them
can import the toolkit. When the build has copied them into
``_build/html/_downloads/``, this extension rewrites the copies there
(``build-finished``), always from Sphinx-Gallery's files and the current
toolkit, so the result is the same however many builds ran before:

* **the .py**: right after its docstring (and any ``from __future__``
  import), a commented block defines the module ``ragged_toolkit`` from its
  source, embedded as a string (:func:`carry_toolkit`);
* **the notebook**: its second cell writes ``ragged_toolkit.py`` into the
  kernel's folder with ``%%writefile`` (after the install cell,
  ``notebook_cell.py``), and a page that needs more than the first cell
  installs gets its own install cell third (``page_install_cell``); no
  empty code cell is left (a cell that held only
  ``# sphinx_gallery_tags``); and the rST that Sphinx-Gallery leaves in the
  markdown cells (grids and cards, notes, tables, ``literalinclude``, roles)
  becomes Markdown (:func:`rst_to_markdown`, :func:`notebook_for_download`);
* **the zip**: those two files and ``ragged_toolkit.py``.

Sphinx-Gallery's own files in ``auto_tutorials/`` are left as they are: it
compares ``<stem>.py`` with the source to decide what to run again, and
Sphinx re-reads a page whose download file changed, so rewriting them there
would cost a re-read of every page on every build. The module itself is
downloadable too ("Download the toolkit", ``page_links.py``).

Standard library only: the merge job of the GPU build runs this without
nbformat.
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
from notebook_cell import PAGE_CELL_HEAD, page_install_cell

MODULE = TOOLKIT.removesuffix(".py")  # "ragged_toolkit"

# --- rST left in a markdown cell -> Markdown ------------------------------------
#
# Sphinx-Gallery converts some rST itself (headings, links, ``.. math::`` and
# ``.. note::`` at the start of a line, ``:math:``, ``code-block``) and leaves
# the rest as it is. ``include(path)`` returns a file that a literalinclude
# names (relative to the gallery folder); ``refs(role, target)`` returns
# ``(title, url)`` for a cross-reference, either of which may be None.

Include = Callable[[str], str]
Refs = Callable[[str, str], "tuple[str | None, str | None]"]

_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\.[ \t]+(?P<name>[\w:+-]+)::(?:[ \t]+(?P<arg>.*))?[ \t]*$")
_COMMENT = re.compile(r"^(?P<indent>[ \t]*)\.\.(?:[ \t]+(?![\w:+-]+::)(?!_)(?!\|).*)?$")
_OPTION = re.compile(r"^:(?P<name>[\w-]+):(?:[ \t]+(?P<value>.*))?$")
_FENCE = re.compile(r"^[ \t]*(```|~~~)")
_ROLE = re.compile(r"(?<![\w`\\]):(?P<role>[A-Za-z][\w.+-]*(?::[A-Za-z][\w.+-]*)*):`(?P<content>[^`]+)`(?!`)")
# What Sphinx-Gallery makes of :ref:`text <label>`: `text <label>`.
_MANGLED_REF = re.compile(r"(?<![`\w:])`(?P<text>[^`<>]+?)\s*<(?P<label>[^`<>\s]+)>`(?![`_])")
_EXPLICIT = re.compile(r"^(?P<text>.*?)\s*<(?P<target>[^<>]+)>$", re.S)

ADMONITIONS = {
    "note": "Note", "tip": "Tip", "hint": "Hint", "important": "Important",
    "warning": "Warning", "caution": "Caution", "attention": "Attention",
    "danger": "Danger", "error": "Error", "seealso": "See also",
}
VERSIONS = {"versionadded": "New in version", "versionchanged": "Changed in version",
            "deprecated": "Deprecated since version", "versionremoved": "Removed in version"}
DROPPED = {"raw", "contents", "toctree", "minigallery", "highlight", "index", "currentmodule",
           "rst-class", "cssclass", "default-role", "role", "meta", "include", "tags",
           "sectionauthor", "moduleauthor", "codeauthor", "autosummary", "title"}
CODE_ROLES = {"func", "meth", "class", "mod", "attr", "exc", "data", "obj", "const", "any",
              "envvar", "file", "command", "program", "samp", "code", "literal", "kbd",
              "option", "makevar", "regexp", "type", "member", "var", "macro", "struct",
              "function", "method", "property", "enum", "enumerator"}
CALLABLE_ROLES = {"func", "meth", "function", "method"}
DROPPED_ROLES = {"octicon", "fa", "icon", "raw"}
_ICON = re.compile(r":(?:%s):`[^`]*`[ \t]?" % "|".join(sorted(DROPPED_ROLES)))


def _indent_of(line: str) -> int:
    line = line.expandtabs()
    return len(line) - len(line.lstrip())


def _split_directive(lines: list[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """The lines after a directive's first line (already dedented) as
    (argument continuation, options, body)."""
    arg, options, i = [], {}, 0
    while i < len(lines) and lines[i].strip():
        m = _OPTION.match(lines[i].strip())
        if m:
            value = (m.group("value") or "").strip()
            i += 1
            while i < len(lines) and lines[i].strip() and lines[i][:1] in " \t":
                value += " " + lines[i].strip()
                i += 1
            options[m.group("name")] = value
        elif options:  # content straight after the options, with no blank line
            break
        else:
            arg.append(lines[i].strip())
            i += 1
    body = lines[i:]
    while body and not body[0].strip():
        body = body[1:]
    return arg, options, body


def _pyobject(source: str, name: str) -> str:
    """The source of the function, class or assignment ``name`` (dotted for a
    method) in ``source``, with its decorators, dedented."""
    nodes_, node = ast.parse(source).body, None
    for part in name.split("."):
        found = None
        for n in nodes_:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part:
                found = n
            elif isinstance(n, ast.Assign) and any(getattr(t, "id", None) == part for t in n.targets):
                found = n
            elif isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == part:
                found = n
        if found is None:
            raise LookupError(f"no object {name!r} in the included file")
        node, nodes_ = found, getattr(found, "body", [])
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    lines = source.splitlines()[start - 1:node.end_lineno]
    return textwrap.dedent("\n".join(lines))


def _line_ranges(spec: str, count: int) -> list[int]:
    """The 0-based line numbers that literalinclude's ``:lines:`` selects."""
    chosen = []
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-", 1)
            chosen += range(int(a or 1) - 1, int(b) if b else count)
        elif part:
            chosen.append(int(part) - 1)
    return [i for i in chosen if 0 <= i < count]


def _literalinclude(arg: str, options: dict[str, str], include: Include | None) -> list[str]:
    if include is None:
        raise ValueError(f"literalinclude of {arg!r} with no way to read it")
    text = include(arg)
    if "pyobject" in options:
        text = _pyobject(text, options["pyobject"])
    if "start-after" in options:
        text = text.split(options["start-after"], 1)[1].split("\n", 1)[-1]
    if "end-before" in options:
        text = text.split(options["end-before"], 1)[0].rsplit("\n", 1)[0]
    if "lines" in options:
        lines = text.splitlines()
        text = "\n".join(lines[i] for i in _line_ranges(options["lines"], len(lines)))
    if "dedent" in options:
        text = textwrap.dedent(text)
    language = options.get("language") or ("python" if arg.endswith(".py") else "")
    out = [f"**{options['caption']}**", ""] if options.get("caption") else []
    return out + [f"```{language}", *text.strip("\n").splitlines(), "```"]


def _list_table(title: str, options: dict[str, str], body: list[str], convert) -> list[str]:
    rows, cur = [], None
    for line in textwrap.dedent("\n".join(body)).splitlines():
        if line.startswith("*") and line[1:2] in ("", " "):
            cur = [line[2:]]
            rows.append(cur)
        elif cur is not None:
            cur.append(line[2:] if line[:2] == "  " else line.strip())
    table = []
    for row in rows:
        cells, cell = [], None
        for line in row:
            if line.startswith("-") and line[1:2] in ("", " "):
                cell = [line[2:]]
                cells.append(cell)
            elif cell is not None:
                cell.append(line)
        table.append([" ".join(" ".join(convert(textwrap.dedent("\n".join(c)).splitlines())).split())
                      .replace("|", "\\|") for c in cells])
    if not table:
        return []
    width = max(len(r) for r in table)
    table = [r + [""] * (width - len(r)) for r in table]
    header_rows = int(options.get("header-rows", "0") or 0)
    header = table[0] if header_rows else [""] * width
    rest = table[1:] if header_rows else table
    out = [f"**{title}**", ""] if title else []
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join(" --- " for _ in range(width)) + "|")
    out += ["| " + " | ".join(r) + " |" for r in rest]
    return out


def _glossary(body: list[str], convert) -> list[str]:
    lines = textwrap.dedent("\n".join(body)).splitlines()
    out, terms, definition = [], [], []

    def flush():
        if terms:
            out.extend([", ".join(f"**{t}**" for t in terms), ""])
            out.extend(convert(textwrap.dedent("\n".join(definition)).strip("\n").splitlines()))
            out.append("")

    for line in lines:
        if line.strip() and not line[:1].isspace():
            if definition:
                flush()
                terms, definition = [], []
            terms.append(line.strip())
        elif terms:
            definition.append(line)
    flush()
    return out


def _quote(title: str, body: list[str]) -> list[str]:
    lines = [f"**{title}**", ""] if title else []
    lines += body
    while lines and not lines[-1].strip():
        lines.pop()
    return [("> " + ln).rstrip() for ln in lines]


def _directive(name: str, arg: str, options: dict[str, str], body: list[str],
               include: Include | None) -> list[str] | None:
    """Markdown lines for one directive (its body not yet converted), or
    None for a directive whose lines are dropped."""
    name = name.rsplit(":", 1)[-1]  # py:function -> function
    convert = lambda lines: _blocks(lines, include)  # noqa: E731
    inner = lambda: convert(textwrap.dedent("\n".join(body)).splitlines())  # noqa: E731
    if name in DROPPED:
        return None
    if name == "only":
        return inner() if "html" in arg else None
    if name == "grid":
        return inner()
    if name in ("grid-item-card", "card", "grid-item", "tab-item", "dropdown", "topic", "sidebar", "rubric"):
        title = " ".join(_ICON.sub("", arg).split())
        if title and options.get("link", "").startswith(("http://", "https://")):
            title = f"[{title}]({options['link']})"
        content = [ln for ln in inner() if not re.fullmatch(r"\s*(\^{3,}|\+{3,})\s*", ln)]
        return ([f"**{title}**", ""] if title else []) + content
    if name in ADMONITIONS or name == "admonition":
        title = arg if name == "admonition" else ADMONITIONS[name]
        first = [] if name == "admonition" or not arg else [arg, ""]
        return _quote(title, convert(first + textwrap.dedent("\n".join(body)).splitlines()))
    if name in VERSIONS:
        version, _, rest = arg.partition(" ")
        return _quote(f"{VERSIONS[name]} {version}", convert(([rest, ""] if rest else [])
                                                             + textwrap.dedent("\n".join(body)).splitlines()))
    if name == "literalinclude":
        return _literalinclude(arg, options, include)
    if name in ("code-block", "code", "sourcecode"):
        out = [f"**{options['caption']}**", ""] if options.get("caption") else []
        return out + [f"```{arg}", *textwrap.dedent("\n".join(body)).strip("\n").splitlines(), "```"]
    if name == "math":
        text = "\n".join([arg] + textwrap.dedent("\n".join(body)).splitlines()).strip()
        return ["$$", *text.splitlines(), "$$"] if text else None
    if name == "list-table":
        return _list_table(arg, options, body, convert)
    if name == "glossary":
        return _glossary(body, convert)
    if name in ("image", "figure"):
        alt = options.get("alt", "")
        out = [f"![{alt}]({arg})"]
        caption = inner() if name == "figure" else []
        return out + ([""] + caption if caption else [])
    # Anything else: its argument and its content, as text.
    return ([arg, ""] if arg else []) + inner()


def _blocks(lines: list[str], include: Include | None) -> list[str]:
    """Replace every directive (and rST comment) in ``lines``, outside fenced code."""
    out, i, fence = [], 0, None
    while i < len(lines):
        line = lines[i]
        f = _FENCE.match(line)
        if fence is not None:
            out.append(line)
            if f and f.group(1) == fence:
                fence = None
            i += 1
            continue
        if f:
            fence = f.group(1)
            out.append(line)
            i += 1
            continue
        m = _DIRECTIVE.match(line) or _COMMENT.match(line)
        if not m:
            out.append(line)
            i += 1
            continue
        indent = _indent_of(line)
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or _indent_of(lines[j]) > indent):
            j += 1
        while j > i + 1 and not lines[j - 1].strip():
            j -= 1
        block = textwrap.dedent("\n".join(lines[i + 1:j])).splitlines()
        i = j
        if "name" not in m.groupdict():  # a comment
            continue
        arg_more, options, body = _split_directive(block)
        arg = " ".join([(m.group("arg") or "").strip(), *arg_more]).strip()
        rendered = _directive(m.group("name"), arg, options, body, include)
        if rendered is None:
            continue
        pad = m.group("indent")
        if out and out[-1].strip():
            out.append("")
        out.extend((pad + ln) if ln.strip() else "" for ln in rendered)
        out.append("")
    return out


def _inline_code(text: str) -> str:
    tick = "``" if "`" in text else "`"
    pad = " " if tick == "``" else ""
    return f"{tick}{pad}{text}{pad}{tick}"


def _role(m: re.Match, refs: Refs | None) -> str:
    role, content = m["role"], " ".join(m["content"].split())
    kind = role.split(":")[-1]
    explicit = _EXPLICIT.match(content)
    text, target = (explicit["text"], explicit["target"]) if explicit and explicit["text"] else (None, content)
    if kind in DROPPED_ROLES:
        return ""
    if kind == "math":
        return f"${m['content']}$"
    if kind in ("sub", "sup"):
        return f"<{kind}>{content}</{kind}>"
    if kind == "abbr":
        return content
    if kind in ("pep", "rfc"):
        number = int(re.sub(r"\D.*", "", target) or 0)
        url = (f"https://peps.python.org/pep-{number:04d}/" if kind == "pep"
               else f"https://datatracker.ietf.org/doc/html/rfc{number}")
        return f"[{text or kind.upper() + ' ' + str(number)}]({url})"
    if kind in CODE_ROLES:
        if text:
            return _inline_code(text)
        shown = target.lstrip("!")
        if shown.startswith("~"):
            shown = shown[1:].rsplit(".", 1)[-1]
        if kind in CALLABLE_ROLES and not shown.endswith(")"):
            shown += "()"
        return _inline_code(shown)
    if kind == "download":
        return text or _inline_code(posixpath.basename(target))
    if kind in ("ref", "doc", "term", "numref", "keyword", "token", "label"):
        title, url = refs(kind, target) if refs else (None, None)
        shown = text or title or (posixpath.basename(target) if kind == "doc" else target)
        return f"[{shown}]({url})" if url else f"*{shown}*"
    if kind == "menuselection":
        return content.replace("-->", "→")
    return text or content  # guilabel, command, and any other role: its text


def _inline(text: str, refs: Refs | None) -> str:
    text = _ROLE.sub(lambda m: _role(m, refs), _ICON.sub("", text))

    def mangled(m):
        title, url = refs("ref", m["label"]) if refs else (None, None)
        return f"[{m['text']}]({url})" if url else f"*{m['text']}*"

    return _MANGLED_REF.sub(mangled, text)


def rst_to_markdown(text: str, *, include: Include | None = None, refs: Refs | None = None) -> str:
    """A markdown cell's text, with the rST that Sphinx-Gallery left in it
    converted: directives to Markdown blocks, roles to text, code or links."""
    lines = _blocks(text.splitlines(), include)
    out, fence, chunk = [], None, []
    for line in lines + [None]:
        f = line is not None and _FENCE.match(line)
        if line is None or (fence is None and f):
            if chunk:
                out.append(_inline("\n".join(chunk), refs))
                chunk = []
            if line is not None:
                fence = f.group(1)
                out.append(line)
            continue
        if fence is not None:
            out.append(line)
            if f and f.group(1) == fence:
                fence = None
            continue
        chunk.append(line)
    result = re.sub(r"\n{3,}", "\n\n", "\n".join(out))
    return result.strip("\n") + "\n" if result.strip() else ""


# --- the notebook ----------------------------------------------------------------

WRITEFILE = f"%%writefile {TOOLKIT}"


def toolkit_cell(toolkit_source: str) -> dict:
    """A code cell that writes the toolkit into the kernel's folder."""
    return {
        "cell_type": "code",
        "execution_count": None,
        # Collapsed where the front end honours it (JupyterLab, Notebook 7):
        # a thousand lines a reader runs, not reads, here.
        "metadata": {"collapsed": False, "jupyter": {"source_hidden": True}},
        "outputs": [],
        "source": f"{WRITEFILE}\n{toolkit_source}",
    }


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def notebook_for_download(nb: dict, toolkit_source: str, *, include: Include | None = None,
                          refs: Refs | None = None, page_cell: str | None = None) -> dict:
    """Sphinx-Gallery's notebook as it is downloaded: the install cell, then
    the cell that writes the toolkit, then ``page_cell`` (what only this page
    installs) if any, then the page, with no empty code cell and no rST in
    its markdown. Applied to its own result it changes nothing."""
    nb = copy.deepcopy(nb)
    cells = []
    for cell in nb["cells"]:
        src = _source(cell)
        if cell["cell_type"] == "code" and (not src.strip() or src.startswith((WRITEFILE, PAGE_CELL_HEAD))):
            continue
        if cell["cell_type"] == "markdown":
            src = rst_to_markdown(src, include=include, refs=refs)
            if not src.strip():
                continue
            cell["source"] = src
        cells.append(cell)
    at = 1 if cells and cells[0]["cell_type"] == "code" else 0  # after the install cell
    cells.insert(at, toolkit_cell(toolkit_source))
    if page_cell:
        cells.insert(at + 1, {"cell_type": "code", "execution_count": None, "metadata": {},
                              "outputs": [], "source": page_cell})
    nb["cells"] = cells
    return nb


def dump_notebook(nb: dict) -> str:
    return json.dumps(nb, indent=2, ensure_ascii=False) + "\n"


# --- the .py -----------------------------------------------------------------------

BEGIN = f"# --- The site's toolkit module, {MODULE}, carried so that this script runs on its own"
END = f"# --- End of the toolkit module"
_CARRIED = re.compile(rf"\n?^{re.escape(BEGIN)}.*?^{re.escape(END)}[^\n]*\n\n?", re.M | re.S)


def source_literal(source: str) -> str:
    """``source`` as a raw triple-quoted literal that evaluates back to it
    exactly; ValueError when no such literal exists."""
    if "\r" in source:
        raise ValueError(f"{TOOLKIT} has a carriage return: a string literal would not keep it")
    for quote in ("'''", '"""'):
        if quote in source or source.endswith((quote[0], "\\")):
            continue
        literal = f"r{quote}{source}{quote}"
        try:
            if ast.literal_eval(literal) == source:
                return literal
        except (SyntaxError, ValueError):
            pass
    raise ValueError(f"{TOOLKIT} holds both ''' and \"\"\" (or ends in a quote or a backslash): "
                     "it cannot be embedded as a raw string literal")


def toolkit_block(toolkit_source: str) -> str:
    """The lines that define the module ``ragged_toolkit`` from its source."""
    name = MODULE
    return f'''\
{BEGIN}
# Every page of the site imports one module, {name} ("Download the toolkit"
# on the page gives it as a file: {TOOLKIT}). This block, written when the
# site was built, defines that module from its source, so the imports below
# need nothing beside this script.
import linecache as _linecache
import sys as _sys
import types as _types

_TOOLKIT_SOURCE = {source_literal(toolkit_source)}
_toolkit = _types.ModuleType({name!r})
_toolkit.__file__ = {TOOLKIT!r}
_sys.modules[{name!r}] = _toolkit  # before it runs: dataclasses look the module up
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
    """``script`` with :func:`toolkit_block` right after its docstring and
    ``from __future__`` imports, before its first code. Applied to its own
    result it replaces the block instead of adding a second one."""
    script = _CARRIED.sub("\n", script, count=1) if BEGIN in script else script
    body, at, k = ast.parse(script).body, 0, 0
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        at, k = body[0].end_lineno, 1
    while k < len(body) and isinstance(body[k], ast.ImportFrom) and body[k].module == "__future__":
        at, k = body[k].end_lineno, k + 1
    lines = script.splitlines(keepends=True)
    head = "".join(lines[:at]).rstrip("\n")
    tail = "".join(lines[at:]).lstrip("\n")
    block = toolkit_block(toolkit_source)
    return (f"{head}\n\n{block}\n{tail}" if head else f"{block}\n{tail}")


# --- the zip ------------------------------------------------------------------------

def zip_bytes(files: dict[str, str]) -> bytes:
    """A zip of ``name -> text``, the same bytes for the same files."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in files.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, text.encode("utf-8"))
    return buf.getvalue()


# --- Sphinx -------------------------------------------------------------------------

def _write(path: Path, data: bytes) -> None:
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)


def _refs(app) -> Refs:
    """Titles (and, where conf.py sets ``html_baseurl``, URLs) of the pages
    and sections a role names."""
    env, base = app.env, (app.config.html_baseurl or "").rstrip("/")
    labels = env.get_domain("std").labels

    def url(docname, anchor=""):
        if not base:
            return None
        return f"{base}/{app.builder.get_target_uri(docname)}" + (f"#{anchor}" if anchor else "")

    def resolve(kind, target):
        if kind == "ref" and target.lower() in labels:
            docname, anchor, title = labels[target.lower()]
            return title or None, url(docname, anchor)
        if kind == "doc":
            docname = posixpath.normpath(target.lstrip("/") if target.startswith("/")
                                         else posixpath.join(GALLERY_OUT, target))
            title = env.titles[docname].astext() if docname in env.titles else None
            return title, url(docname) if docname in env.all_docs else None
        return None, None

    return resolve


def check_toolkit(app) -> None:
    """``builder-inited``: fail at once, not after every page ran, when the
    toolkit cannot be carried in a string literal."""
    path = Path(app.srcdir) / GALLERY_SRC / TOOLKIT
    if path.exists():
        from sphinx.errors import ExtensionError
        try:
            source_literal(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise ExtensionError(str(err)) from None


def write_downloads(app, exc) -> None:
    """``build-finished``: the downloads of every tutorial, rewritten in the
    output from Sphinx-Gallery's files and the current toolkit."""
    if exc is not None or not getattr(app.builder, "download_support", False):
        return
    src = Path(app.srcdir)
    toolkit_path = src / GALLERY_SRC / TOOLKIT
    if not toolkit_path.exists():
        return
    toolkit = toolkit_path.read_text(encoding="utf-8")
    gallery = src / GALLERY_OUT
    stems = {p.stem for p in tutorial_sources(src)}
    downloads = Path(app.outdir) / "_downloads"
    def include(rel):  # as Sphinx reads a literalinclude's path: "/..." from the sources
        path = src / rel.lstrip("/") if rel.startswith("/") else gallery / rel
        return path.resolve().read_text(encoding="utf-8")

    refs = _refs(app)
    made: dict[str, dict[str, str]] = {}  # stem -> suffix -> text
    minimums = src / "requirements-minimum.txt"

    def page_cell(stem):  # what only this page installs (notebook_cell.py)
        return page_install_cell(minimums, stem) if minimums.exists() else None

    def text_for(stem, suffix):
        if suffix not in made.setdefault(stem, {}):
            if suffix == ".py":
                made[stem][suffix] = carry_toolkit((gallery / f"{stem}.py").read_text(encoding="utf-8"), toolkit)
            else:
                nb = json.loads((gallery / f"{stem}.ipynb").read_text(encoding="utf-8"))
                try:
                    nb = notebook_for_download(nb, toolkit, include=include, refs=refs,
                                               page_cell=page_cell(stem))
                except (LookupError, ValueError, OSError) as err:
                    from sphinx.errors import ExtensionError
                    raise ExtensionError(f"{GALLERY_SRC}/{stem}.py: its notebook: {err}") from None
                made[stem][suffix] = dump_notebook(nb)
        return made[stem][suffix]

    for rel, (_docs, dest) in list(app.env.dlfiles.items()):
        rel = Path(rel)
        if rel.parent.as_posix() != GALLERY_OUT or rel.stem not in stems:
            continue
        target = downloads / str(dest)
        if not target.parent.is_dir():
            continue
        stem, suffix = rel.stem, rel.suffix
        if suffix in (".py", ".ipynb"):
            _write(target, text_for(stem, suffix).encode("utf-8"))
        elif suffix == ".zip":
            _write(target, zip_bytes({f"{stem}.py": text_for(stem, ".py"),
                                      f"{stem}.ipynb": text_for(stem, ".ipynb"),
                                      TOOLKIT: toolkit}))


def setup(app):
    app.connect("builder-inited", check_toolkit, priority=320)
    app.connect("build-finished", write_downloads)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
