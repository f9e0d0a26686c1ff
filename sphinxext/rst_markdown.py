"""The rST the pages write, as Markdown for the downloaded notebooks
(:func:`rst_to_markdown`, which :mod:`downloads` calls).

Sphinx-Gallery converts headings, links, notes, math and code blocks at the
start of a line. The rest that the pages use is converted here; anything
else fails the build, naming the page and the word. ``include(path)`` reads
what a literalinclude names; ``links(role, target)`` gives the title (a
:doc:'s, or None) and the URL of the published page a :doc:, :ref: or
:term: leads to (or None: the text stays as it is). Standard library only.
"""

from __future__ import annotations

import ast
import posixpath
import re
import textwrap
from typing import Callable


Include = Callable[[str], str]
Links = Callable[[str, str], "tuple[str | None, str | None]"]

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


def _directive(name: str, arg: str, options: dict, body: list[str], include, links) -> list[str]:
    convert = lambda lines: _blocks(lines, include, links)  # noqa: E731
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
                     "way, or teach sphinxext/rst_markdown.py (_directive) to convert it")


def _blocks(lines: list[str], include: Include | None, links: Links | None) -> list[str]:
    """``lines`` with every directive converted and every rST comment dropped,
    code fences left alone, roles converted outside them."""
    out, i, fence, text = [], 0, None, []

    def flush():
        out.extend(_inline("\n".join(text), links).split("\n") if text else [])
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
        rendered = _directive(m["name"], m["arg"].strip(), options, block, include, links)
        if out and out[-1].strip():
            out.append("")
        out += [(m["indent"] + ln) if ln.strip() else "" for ln in rendered] + [""]
    flush()
    return out


def _role(kind: str, content: str, links: Links | None) -> str:
    kind, content = kind.split(":")[-1], " ".join(content.split())
    explicit = _EXPLICIT.match(content)
    text, target = (explicit["text"], explicit["target"]) if explicit else (None, content)
    if kind == "octicon":
        return ""
    if kind in ("ref", "doc", "term"):
        title, url = links(kind, target) if links else (None, None)
        text = text or title or (posixpath.basename(target) if kind == "doc" else target)
        return f"[{text}]({url})" if url else f"*{text}*"
    raise ValueError(f"the role :{kind}: has no Markdown form in the downloaded notebook: write it another "
                     "way, or teach sphinxext/rst_markdown.py (_role) to convert it")


def _inline(text: str, links: Links | None) -> str:
    text = _ROLE.sub(lambda m: _role(m["role"], m["content"], links), text)
    return _MANGLED_REF.sub(lambda m: _role("ref", f"{m['text']} <{m['label']}>", links), text)


def rst_to_markdown(text: str, *, include: Include | None = None, links: Links | None = None) -> str:
    """A markdown cell's text with the rST Sphinx-Gallery left in it converted."""
    result = re.sub(r"\n{3,}", "\n\n", "\n".join(_blocks(text.splitlines(), include, links)))
    return result.strip("\n") + "\n" if result.strip() else ""


