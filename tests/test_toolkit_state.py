"""The toolkit keeps no hidden state and says what is public (issue 32): no
module-level container or cache is changed at run time (what is expensive
to build is built by a call the caller sees and passed on), no module
reaches into another's private names, and every module names its public
API in ``__all__``, each name defined there."""

from __future__ import annotations

import ast
import re

import pytest

from sitebuild import REPO
from toolkit_api import FILES, MODULES

from gallery_layout import PACKAGES  # (on the path through sitebuild)

MUTATORS = {"append", "extend", "insert", "update", "pop", "popitem", "clear", "setdefault", "add", "remove",
            "discard", "__setitem__"}


def module_state_changes(path):
    """Where a module changes a list, dict or set it holds at module level:
    ``(line, name.method)`` for each call of a mutating method on it, and
    each item assignment or ``global`` rebinding of it."""
    tree = ast.parse(path.read_text())
    containers = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                  and isinstance(node.value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.Call))
                  and not (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "")
                           not in ("list", "dict", "set", "defaultdict", "OrderedDict"))
                  for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                  if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in containers \
                and node.func.attr in MUTATORS:
            found.append((node.lineno, f"{node.func.value.id}.{node.func.attr}"))
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in containers:
                    found.append((node.lineno, f"{t.value.id}[...] ="))
        if isinstance(node, ast.Global):
            found += [(node.lineno, f"global {n}") for n in node.names]
    return sorted(found)


@pytest.mark.parametrize("name", sorted(FILES), ids=str)
def test_no_module_level_state_changes_at_run_time(name):
    found = module_state_changes(FILES[name])
    assert not found, f"{FILES[name].name}: " + ", ".join(f"line {line}: {what}" for line, what in found)


def test_the_state_check_finds_a_module_cache(tmp_path):
    module = tmp_path / "cached.py"
    module.write_text("_RECENT = []\n_SEEN = {}\n\n\ndef plan(x):\n    _RECENT.insert(0, x)\n"
                      "    _SEEN[x] = 1\n    return x\n")
    assert module_state_changes(module) == [(6, "_RECENT.insert"), (7, "_SEEN[...] =")]


def private_reaches(path):
    """Where a module uses another toolkit module's private names: imports a
    ``_name`` from it, or reads ``module._name`` of a module it imported."""
    tree = ast.parse(path.read_text())
    toolkit_import = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      and (node.level or (node.module or "").split(".")[0] in PACKAGES)]
    short = {m.rsplit(".", 1)[-1] for m in MODULES}
    modules = {a.asname or a.name for node in toolkit_import for a in node.names if a.name in short}
    found = [(node.lineno, f"from {'.' * node.level}{node.module or ''} import {a.name}")
             for node in toolkit_import for a in node.names if a.name.startswith("_")]
    found += [(node.lineno, f"{node.value.id}.{node.attr}") for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in modules and node.attr.startswith("_") and not node.attr.startswith("__")]
    return sorted(found)


@pytest.mark.parametrize("name", sorted(FILES), ids=str)
def test_no_module_reaches_into_another_modules_private_names(name):
    found = private_reaches(FILES[name])
    assert not found, f"{FILES[name].name} uses another module's private names: " + \
        "; ".join(f"line {line}: {what}" for line, what in found)


def compile_state(path):
    """Where a module keeps or changes compile state that is not its caller's:
    ``torch.compile`` called at module level (a graph cache for the whole
    process), any use of ``torch._dynamo.config``, and ``torch._dynamo.reset``
    (it wipes every caller's graphs). ``(line, what)`` each."""
    tree = ast.parse(path.read_text())
    found = []
    in_functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                    for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        text = ast.unparse(node) if isinstance(node, (ast.Attribute, ast.Call)) else ""
        if isinstance(node, ast.Call) and text.startswith("torch.compile(") and id(node) not in in_functions:
            found.append((node.lineno, "torch.compile at module level"))
        if isinstance(node, ast.Attribute) and text in ("torch._dynamo.config", "torch._dynamo.reset"):
            found.append((node.lineno, text))
    return sorted(set(found))


@pytest.mark.parametrize("name", sorted(n for n in FILES if n.split(".")[0] == PACKAGES[0]), ids=str)
def test_no_library_module_keeps_or_changes_compile_state(name):
    found = compile_state(FILES[name])
    assert not found, f"{FILES[name].name}: " + ", ".join(f"line {line}: {what}" for line, what in found)


def test_the_compile_state_check_finds_each_kind(tmp_path):
    module = tmp_path / "compiled.py"
    module.write_text("import torch\n\n_fast = torch.compile(f)\n\n\ndef g(x):\n"
                      "    with torch._dynamo.config.patch(recompile_limit=64):\n        torch._dynamo.reset()\n"
                      "    return torch.compile(f)(x)\n")
    assert compile_state(module) == [(3, "torch.compile at module level"), (7, "torch._dynamo.config"),
                                     (8, "torch._dynamo.reset")]


def test_the_private_check_finds_a_reach(tmp_path):
    module = tmp_path / "reach.py"
    module.write_text("from . import flex\nfrom .plan import _lengths\n\n\ndef f():\n    return flex._compiled\n")
    assert private_reaches(module) == [(2, "from .plan import _lengths"), (6, "flex._compiled")]


def public_definitions(name):
    """The public functions and classes module ``name`` defines itself."""
    return {n for n, v in vars(MODULES[name]).items() if not n.startswith("_")
            and getattr(v, "__module__", name) == name and callable(v)}


def names_used_elsewhere(name):
    """Every name that the other modules of both packages import from module
    ``name`` or read from it as an attribute."""
    used = set()
    for other, path in FILES.items():
        if other == name:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                package = other if path.name == "__init__.py" else other.rpartition(".")[0]
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                if target == name:
                    used |= {a.name for a in node.names}
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
    return used


def shown_internals(page_text):
    """(file, name) of every object a page shows whole, with ``literalinclude``
    and ``:pyobject:`` (a function or class; not a method)."""
    found = re.findall(r"\.\. literalinclude:: \.\./(\S+)\n#\s+:pyobject: (\w+)\n", page_text)
    return {(path, name) for path, name in found}


def page_imports(page_text):
    """(module, name) of every name a page imports from a module of either package."""
    return {(node.module, a.name) for node in ast.walk(ast.parse(page_text))
            if isinstance(node, ast.ImportFrom) and node.module in MODULES for a in node.names}


PAGE_TEXTS = {p.name: p.read_text() for p in sorted((REPO / "tutorials").glob("*.py"))}


#: What the pages show whole, on one page or another.
SHOWN = {shown for text in PAGE_TEXTS.values() for shown in shown_internals(text)}


def names_pages_show_and_call(name):
    """The unlisted names of module ``name`` that a page imports, to run
    them, and the pages show whole (:func:`shown_internals`, on that page or
    the one that teaches them): the internals the pages teach, public but
    not the supported API."""
    path = str(FILES[name].relative_to(REPO))
    return {n for text in PAGE_TEXTS.values() for module, n in page_imports(text)
            if module == name and (path, n) in SHOWN}


@pytest.mark.parametrize("name", sorted(FILES), ids=str)
def test_every_module_lists_what_it_supports(name):
    """``__all__`` is the API a reader may call: every listed name exists
    and has a docstring (the reference page shows it). In the library it
    lists what is supported, not all that exists: a public function or class
    left out of it must be one that another module uses (a shared helper),
    or an internal a page shows whole and then runs (a step it teaches);
    one that nothing else uses is private (``_``). The harness lists all."""
    module = MODULES[name]
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"
    undocumented = [n for n in module.__all__ if callable(getattr(module, n))
                    and not (getattr(module, n).__doc__ or "").strip()]
    assert not undocumented, f"{name}.__all__ lists names with no docstring: {undocumented}"
    unlisted = public_definitions(name) - set(module.__all__)
    if name.split(".")[0] != PACKAGES[0]:
        assert not unlisted, f"{name} defines public functions or classes not in __all__: {sorted(unlisted)}"
    else:
        unused = sorted(unlisted - names_used_elsewhere(name) - names_pages_show_and_call(name))
        assert not unused, (f"{name} defines public functions or classes that no other module uses and "
                            f"__all__ does not list: {unused} (list them, or rename them _)")


def test_pages_import_only_listed_names():
    """A page shows what a reader may call: every name it imports from either
    package is in that module's ``__all__``, or is an internal the pages
    show whole (``literalinclude`` of that module's file with
    ``:pyobject:``) and run: a step they teach, not the supported API."""
    found = []
    for page, text in PAGE_TEXTS.items():
        for module, n in sorted(page_imports(text)):
            path = str(FILES[module].relative_to(REPO))
            if n not in MODULES[module].__all__ and f"{module}.{n}" not in MODULES and (path, n) not in SHOWN:
                found.append(f"{page}: {module}.{n}")
    assert not found, "pages import names their modules do not list (nor show whole): " + ", ".join(found)


def test_an_internal_counts_as_shown_only_where_the_page_includes_it():
    text = ("# .. literalinclude:: ../ragged_toolkit/recurrent.py\n#    :pyobject: chunk_decay\n"
            "from ragged_toolkit.recurrent import chunk_decay, chunked_recurrence\n")
    assert shown_internals(text) == {("ragged_toolkit/recurrent.py", "chunk_decay")}
    assert page_imports(text) == {("ragged_toolkit.recurrent", "chunk_decay"),
                                  ("ragged_toolkit.recurrent", "chunked_recurrence")}


def test_a_plan_and_a_paged_step_are_built_once_and_only_read():
    import dataclasses

    import torch

    from ragged_toolkit.attention import plan_batch
    from ragged_toolkit.gpt import GPTConfig
    from ragged_toolkit.kv_cache import PagedKVCache
    from ragged_toolkit.serving.engine import build_step
    from ragged_toolkit.serving.requests import Request

    plan = plan_batch(torch.tensor([0, 3, 5]), backend="padded", is_causal=True)
    assert (plan.max_q, plan.n_q, plan.n_kv) == (3, 5, 5) and plan.prepared is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.prepared = None
    empty = plan_batch(torch.tensor([0, 3, 3]), backend="padded")  # a sequence without tokens
    assert empty.nonempty[2].n_q == 3 and empty.prepared is None
    cfg = GPTConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=16, max_seq_len=32)
    cache = PagedKVCache(cfg, 4, 4, "cpu", torch.float32)
    cache.reserve(0, 5)
    _, _, layout = build_step(cache, [(Request(0, [1, 2, 3, 4, 5], 1), 5)], "cpu", "gathered", "loop")
    assert layout.prepared is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.slots = layout.slots + 1


def module_imports(name, path, known):
    """The toolkit modules that module ``name`` (file ``path``) imports
    itself, anywhere in it (a function-local import too), by dotted name;
    ``from .pkg import mod`` counts ``pkg.mod`` where it is a module."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[:len(base) - node.level + 1] + (node.module.split(".") if node.module else [])
                target = ".".join(parts)
            else:
                target = node.module or ""
            found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in known and m != name}


def import_cycles(files):
    """Each set of modules that import one another, round a cycle (Tarjan's
    strongly connected components of the import graph), as sorted lists."""
    graph = {name: module_imports(name, path, files) for name, path in files.items()}
    index, low, stack, cycles = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_modules_import_each_other():
    assert import_cycles(FILES) == [], "these modules import one another (a function-local import hides it)"


def test_the_cycle_check_finds_a_function_local_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import g\n\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (package / "c.py").write_text("from . import a\n")
    files = {"pkg": package / "__init__.py", **{f"pkg.{m}": package / f"{m}.py" for m in "abc"}}
    assert import_cycles(files) == [["pkg.a", "pkg.b"]]
