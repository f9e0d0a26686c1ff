"""The library, ``ragged_toolkit``, apart from the site's machinery,
``ragged_site``: the library imports neither the harness nor matplotlib, and
``pip install .`` of it, beside torch and numpy alone, runs attention, the
GPT, the KV cache and the serving engine."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sitebuild import REPO
from toolkit_api import FILES

from gallery_layout import PACKAGES  # (on the path through sitebuild)

LIBRARY = {name: path for name, path in FILES.items() if name.split(".")[0] == "ragged_toolkit"}
FORBIDDEN = ("ragged_site", "matplotlib")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every absolute import in ``path``,
    function-local ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append((node.lineno, (node.module or "").split(".")[0]))
    return found


@pytest.mark.parametrize("name", sorted(LIBRARY), ids=str)
def test_the_library_imports_neither_the_harness_nor_matplotlib(name):
    found = [(line, top) for line, top in imports_of(LIBRARY[name]) if top in FORBIDDEN]
    assert not found, f"{LIBRARY[name].relative_to(REPO)} imports " + ", ".join(f"{t} (line {n})" for n, t in found)


def test_the_import_check_finds_a_function_local_import(tmp_path):
    module = tmp_path / "drawn.py"
    module.write_text("import torch\n\n\ndef draw():\n    import matplotlib.pyplot as plt\n"
                      "    from ragged_site.measuring.timing import measure\n")
    assert [t for _, t in imports_of(module) if t in FORBIDDEN] == ["matplotlib", "ragged_site"]


def test_the_library_is_what_pyproject_installs():
    import tomllib

    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    on_disk = sorted(name for name, path in LIBRARY.items() if path.name == "__init__.py")
    assert sorted(packages) == on_disk, f"pyproject.toml installs {packages}; the library's packages are {on_disk}"


def _distribution_tops(name: str, seen: set[str]) -> set[Path]:
    """The top-level files and folders of distribution ``name`` and of what it
    requires (extras left out), each once."""
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return set()
    seen.add(key)
    dist = metadata.distribution(name)
    tops = {Path(dist.locate_file(f.parts[0])) for f in dist.files or []
            if f.parts[0] != ".." and (len(f.parts) > 1 or f.suffix == ".py")}  # not bin/ scripts
    tops = {p for p in tops if p.exists()}
    for requirement in dist.requires or []:
        if "extra ==" not in requirement:
            tops |= _distribution_tops(re.split(r"[ ;<>=!~\[]", requirement, maxsplit=1)[0], seen)
    return tops


TRY_IT = textwrap.dedent("""\
    import functools
    import importlib.util
    import sys

    for name in ("ragged_site", "matplotlib"):
        assert importlib.util.find_spec(name) is None, f"{name} is importable: the test proves nothing"

    import torch

    from ragged_toolkit.attention import plan_batch, ragged_attention
    from ragged_toolkit.batches import offsets_from_lengths, token_index
    from ragged_toolkit.gpt import GPT, GPTConfig
    from ragged_toolkit.kv_cache import PagedKVCache
    from ragged_toolkit.layouts import PackedLayout
    from ragged_toolkit.serving.requests import Request
    from ragged_toolkit.serving.schedulers import plan_continuous
    from ragged_toolkit.serving.server import serve, take_turns

    torch.manual_seed(0)
    offsets = offsets_from_lengths([3, 5])
    q = torch.randn(8, 2, 8)
    out = ragged_attention(q, q, q, plan_batch(offsets, backend="loop", is_causal=True))
    first = torch.softmax(q[3:8, 0] @ q[3:8, 0].T / 8**0.5 + torch.full((5, 5), float("-inf")).triu(1), -1)
    assert torch.allclose(out[3:8, 0], first @ q[3:8, 0], atol=1e-5)

    cfg = GPTConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32, max_seq_len=64)
    model = GPT(cfg).eval()
    tokens = torch.randint(0, 32, (8,))
    logits = model(tokens, token_index(offsets)[1], PackedLayout.of(offsets, "loop"))
    assert logits.shape == (8, 32)

    cache = PagedKVCache(cfg, 16, 4, "cpu", torch.float32)
    requests = [Request(rid=i, prompt=torch.randint(0, 32, (n,)).tolist(), n_out=4) for i, n in enumerate((3, 6, 2))]
    plan = functools.partial(plan_continuous, max_running=2, token_budget=8)
    with torch.no_grad():
        [run], = take_turns(lambda: serve(model, requests, cache, plan, backend="loop"))
        for req in run.requests:  # each token the argmax of the whole sequence's forward, without a cache
            seq = torch.tensor(req.prompt + req.generated)
            one = offsets_from_lengths([len(seq)])
            chosen = model(seq, token_index(one)[1], PackedLayout.of(one, "loop")).argmax(-1)
            assert chosen[len(req.prompt) - 1 : -1].tolist() == req.generated, (req.rid, req.generated)
    print("ran", sorted(m.split(".")[0] for m in sys.modules if m.startswith("ragged")), len(run.steps), "steps")
""")


def test_pip_install_of_the_library_runs_with_torch_and_numpy_alone(tmp_path):
    """``pip install .`` (no dependencies fetched: torch and numpy are linked
    in from this environment, with what torch requires, and nothing else),
    then attention, the GPT, the paged KV cache and the server, in an
    interpreter that sees only those."""
    source, target = tmp_path / "source", tmp_path / "installed"  # a copy: the build writes beside its sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for name in PACKAGES:  # the harness beside it, as in a clone: not installed
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--no-build-isolation", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    installed = {p.parts[0] for p in (p.relative_to(target) for p in target.iterdir())}
    assert {n for n in installed if not n.endswith(".dist-info")} == {"ragged_toolkit"}, installed
    deps = tmp_path / "deps"
    deps.mkdir()
    for top in _distribution_tops("torch", set()) | _distribution_tops("numpy", set()):
        (deps / top.name).symlink_to(top)
    assert not (deps / "matplotlib").exists()
    script = tmp_path / "try_it.py"
    script.write_text(TRY_IT)
    # -I: no user site, no PYTHONPATH, no current folder; -S: no site-packages
    run = subprocess.run([sys.executable, "-I", "-S", "-c",
                          f"import runpy, sys; sys.path[:0] = [{str(target)!r}, {str(deps)!r}]; "
                          f"runpy.run_path({str(script)!r}, run_name='__main__')"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.startswith("ran ['ragged_toolkit'"), run.stdout


def reference_table(text: str) -> dict[str, list[str]]:
    """Module -> names of the reference page's list of the library's API (a
    bullet per module: it wraps on a phone, where a table's column hides)."""
    return {m: re.findall(r"``(\w+)``", names)
            for m, names in re.findall(r"^\* ``(ragged_toolkit[\w.]*)``: (.*)$", text, flags=re.M)}


def test_the_reference_page_lists_the_library_apart_in_one_list():
    import importlib

    text = (REPO / "toolkit.rst").read_text()
    library, harness = text.index("The library: ``ragged_toolkit``"), text.index("The site's machinery: ``ragged_site``")
    assert library < harness
    assert all(text.index(f"automodule:: {m}\n") < harness for m in LIBRARY), "a library module among the harness"
    assert all(text.index(f"automodule:: {m}\n") > harness for m in FILES if m not in LIBRARY), \
        "a harness module among the library"
    table = reference_table(text)
    shown = {n for names in table.values() for n in names}
    exported = {n: m for m in LIBRARY for n in importlib.import_module(m).__all__}
    assert set(exported) == shown, f"the table lacks {sorted(set(exported) - shown)}, lists {sorted(shown - set(exported))}"
    for module, names in table.items():
        wrong = [n for n in names if n not in importlib.import_module(module).__all__]
        assert not wrong, f"the table lists {wrong} under {module}, which does not export them"


def test_the_list_check_reads_a_line():
    row = "* ``ragged_toolkit.layers``: ``MultiHeadAttention``, ``Extra``\n"
    assert reference_table(row) == {"ragged_toolkit.layers": ["MultiHeadAttention", "Extra"]}


# the packages and every page
FORMATTED = (*PACKAGES, *(str(p.relative_to(REPO)) for p in sorted((REPO / "tutorials").glob("*.py"))))


def test_the_packages_are_formatted_by_the_formatter():
    """``ruff format --check`` (line length 100, from pyproject.toml): a line
    limit is met by the formatter's lines, not by joining them."""
    ruff = Path(sys.executable).with_name("ruff")
    proc = subprocess.run([str(ruff), "format", "--check", "--no-cache", *FORMATTED], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"run `ruff format {' '.join(FORMATTED)}`:\n{proc.stdout}{proc.stderr}"


PAGE_LINES = 600  # a page that needs more teaches two ideas: split it


def test_no_page_is_longer_than_its_cap_once_formatted():
    """Every page at most ``PAGE_LINES`` lines, each formatted by ``ruff format``
    (checked above), so that the cap cannot be met by joining lines."""
    long = {p.name: n for p in sorted((REPO / "tutorials").glob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > PAGE_LINES}
    assert not long, f"pages over {PAGE_LINES} lines: {long}; split them or move code out"
