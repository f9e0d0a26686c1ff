"""The toolkit package as the tests reach it: each module, and its public
names gathered in one namespace, ``tk`` (a page imports each name from its
module; a test reaches many). Names are taken from the module that defines
them, so that a test can patch them where they live (``MODULES``)."""

from __future__ import annotations

import ast
import importlib
import sys
import types

from sitebuild import REPO

sys.path.insert(0, str(REPO))  # this checkout's package, also where another copy is installed
sys.path.insert(0, str(REPO / "sphinxext"))
from gallery_layout import toolkit_modules  # noqa: E402

#: Dotted name -> file of every toolkit module.
FILES = toolkit_modules(REPO)
#: Dotted name -> the imported module.
MODULES = {name: importlib.import_module(name) for name in FILES}


def defined_names(path) -> dict[str, int]:
    """Name -> line of every function, class and variable a file defines at its
    top level (not those it imports)."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(node.name, node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out.setdefault(name.id, node.lineno)
        elif isinstance(node, ast.Try):  # an optional import's stand-in is not the module's own
            continue
    return out


#: Public name -> the dotted name of the module that defines it.
OWNER = {name: module for module, path in FILES.items() for name in defined_names(path)
         if not name.startswith("_")}
tk = types.SimpleNamespace(**{name: getattr(MODULES[module], name) for name, module in OWNER.items()})
