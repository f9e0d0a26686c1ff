"""A page's own statements, run in a test. A page is a script, so a test that
pins what it does runs the page's imports and the statements it names
(functions and classes by name, a stretch of top-level statements, the
statements that call a function) in a namespace the test fills with small
stand-ins: the page's code, not a copy of it, at the sizes of a test."""

from __future__ import annotations

import ast
from pathlib import Path


def _assigns(node: ast.stmt, name: str) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else []
    return any(isinstance(t, ast.Name) and t.id == name for target in targets for t in ast.walk(target))


def _calls(node: ast.stmt, name: str) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name
               for n in ast.walk(node))


def run_page(path: Path, namespace: dict, *, defs=(), start=None, stop=None, calling=None) -> dict:
    """Run in ``namespace`` the top-level imports of page ``path``, then, in
    the page's order: the functions and classes named in ``defs``; the
    statements from the first that assigns ``start`` to the last that
    assigns ``stop``; the statements that call ``calling``. Raises
    ``LookupError`` naming what the page lacks. Returns ``namespace``."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    chosen = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    found = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    if set(defs) - found:
        raise LookupError(f"{path.name} defines no {sorted(set(defs) - found)}")
    chosen += [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in defs]
    if start is not None:
        first = next((i for i, n in enumerate(body) if _assigns(n, start)), None)
        last = max((i for i, n in enumerate(body) if _assigns(n, stop)), default=None)
        if first is None or last is None:
            raise LookupError(f"{path.name} assigns no {start if first is None else stop} at top level")
        chosen += [n for n in body[first:last + 1] if not isinstance(n, (ast.Import, ast.ImportFrom))]
    if calling is not None:
        calls = [n for n in body if _calls(n, calling) and not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        if not calls:
            raise LookupError(f"{path.name} calls no {calling} at top level")
        chosen += calls
    chosen.sort(key=lambda n: n.lineno)
    unique = list({id(n): n for n in chosen}.values())
    exec(compile(ast.Module(body=unique, type_ignores=[]), str(path), "exec"), namespace)
    return namespace
