"""The site's real text, offline: the docstrings of this Python's standard
library, as ``bytes`` documents (a token per byte). The pages train and
serve on it; a trainer brings its own corpus."""

import ast
import gc
import os
import sys
import sysconfig
from pathlib import Path

__all__ = ["docstring_corpus"]

# folders of the standard library whose files are tests, test data or installs
_NOT_LIBRARY = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def _definitions_in_order(body):
    # the modules' classes and functions, in source order, also inside if,
    # try, with and loop statements, without visiting any expression
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, name, ()):
                if isinstance(child, ast.stmt):
                    yield from _definitions_in_order([child])
                else:  # an except handler or a match case holds statements
                    yield from _definitions_in_order(child.body)


def docstring_corpus(min_chars=200, limit=3000):
    """Real text, offline: the docstrings of the modules, classes and functions
    of Python's standard library, read with ``ast`` from the ``.py`` files of
    ``sysconfig.get_paths()["stdlib"]`` (no module is imported), files in the
    order of their paths and definitions in source order, tests left out and
    duplicates dropped. Returns ``(documents, source)``: at most ``limit``
    documents of at least ``min_chars`` characters, each as UTF-8 ``bytes``,
    and a name for where they came from. Read afresh at every call (about a
    second): a page reads it once and keeps it."""
    root, files = sysconfig.get_paths()["stdlib"], []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _NOT_LIBRARY]
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    seen, documents = set(), []
    for path in sorted(files, key=lambda f: Path(f).relative_to(root).parts):
        # a syntax tree is many small objects: with torch loaded, the
        # garbage collector's passes over them would triple the time
        collecting = gc.isenabled()
        gc.disable()
        try:
            tree = ast.parse(Path(path).read_bytes())
        except (SyntaxError, ValueError):  # Python 2 examples kept as data
            continue
        finally:
            if collecting:
                gc.enable()
        for node in [tree, *_definitions_in_order(tree.body)]:
            text = ast.get_docstring(node)
            if text and len(text) >= min_chars and text not in seen:
                seen.add(text)
                documents.append(text.encode("utf-8"))
        if limit is not None and len(documents) >= limit:
            break
    version = ".".join(map(str, sys.version_info[:2]))
    return documents[:limit], f"the Python {version} standard library's docstrings"
