"""The CUDA plan audit (``scripts/cuda_audit.py``) on a machine without a GPU:
each page's CUDA sizes, full and quick, against the head sizes the CUDA
kernels take and the documents and tokens the corpus holds; fixture pages
with one planted fault each, every real page (a new page too, with no
change here), and the deeper audit on fake CUDA tensors where PyTorch is a
CUDA build."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

from sitebuild import FIXTURES, REPO
from test_toolkit_state import PACKAGES, private_reaches  # the toolkit's packages, and its own check

sys.path.insert(0, str(REPO / "scripts"))
import cuda_audit  # noqa: E402

PAGES = FIXTURES / "cuda_audit"
SCRIPT = REPO / "scripts" / "cuda_audit.py"


def _faults(name: str) -> list[str]:
    result = cuda_audit.audit_page(PAGES / f"{name}.py")
    print("\n".join(result.lines + ["FAULT " + f for f in result.faults]))
    return result.faults


# --- the fixtures: one fault each ------------------------------------------------------

def test_a_page_whose_sizes_suit_the_gpu_passes():
    assert _faults("good_page") == []
    lines = cuda_audit.audit_page(PAGES / "good_page.py").lines
    assert lines[0].startswith("good_page (full): top level: 8 heads of 64; model: 8 heads (2 key/value) of 64;")
    assert lines[1].startswith("good_page (quick): top level: 8 heads of 16; model: 8 heads (2 key/value) of 16;")


def test_a_quick_cuda_head_size_of_4_is_caught_for_both_kernels():
    assert _faults("quick_head_size_4") == [
        "quick_head_size_4 (quick): model: head size 4 on varlen: FlashAttention needs a head size that is a "
        "multiple of 8, at most 256, not 4",
        "quick_head_size_4 (quick): model: head size 4 on flex: FlexAttention on CUDA needs a head size of at "
        "least 16, not 4"]


def test_more_train_tokens_than_the_corpus_holds_is_caught():
    faults = _faults("too_many_tokens")
    tokens = sum(cuda_audit.corpus_lengths(2)[:3000])
    assert faults == [f"too_many_tokens (full): train_tokens 3,276,800 > the {tokens:,} tokens of the 3,000 "
                      f"documents read (docstring_corpus(min_chars=2, limit=3000)): "
                      f"{3_276_800 / tokens:.2f}x the corpus"], faults


def test_a_page_without_sizes_is_named():
    assert _faults("no_sizes") == [
        "no_sizes.py: no SIZES literal at the top level: state the CUDA, CPU and quick sizes in one dict, "
        "SIZES = {'cuda': {...}, 'cpu': {...}, 'quick': {...}} (CONTRIBUTING.md, 'Device and sizes')"]


def test_the_command_line_names_every_fault_and_fails(capsys):
    assert cuda_audit.main([str(p) for p in sorted(PAGES.glob("*.py"))]) == 1
    out = capsys.readouterr().out
    print(out)
    faults = [ln for ln in out.splitlines() if ln.startswith("FAULT ")]
    assert [f.split()[1] for f in faults] == ["no_sizes.py:", "quick_head_size_4", "quick_head_size_4",
                                              "too_many_tokens"]
    assert out.splitlines()[-1] == "cuda audit: 4 pages, 4 faults"


# --- the rules, one at a time ----------------------------------------------------------

def test_sizes_are_read_as_literals_dict_calls_included(tmp_path):
    page = tmp_path / "page.py"
    page.write_text("SIZES = {'cuda': dict(batch=8, model=dict(dim=64)), 'cpu': {'batch': 2}}\n")
    assert cuda_audit.read_sizes(page) == {"cuda": {"batch": 8, "model": {"dim": 64}}, "cpu": {"batch": 2}}
    page.write_text("BATCH = 8\nSIZES = {'cuda': dict(batch=BATCH), 'cpu': {}}\n")
    with pytest.raises(cuda_audit.NoSizes, match="page.py, line 2: SIZES is not a literal"):
        cuda_audit.read_sizes(page)
    page.write_text("SIZES = {'gpu': {}, 'cpu': {}}\n")
    with pytest.raises(cuda_audit.NoSizes, match="'cuda' and 'cpu' dicts"):
        cuda_audit.read_sizes(page)
    page.write_text("SIZES = {'cuda': {}, 'cpu': {}, 'fast': {}}\n")
    with pytest.raises(cuda_audit.NoSizes, match=r"keys \['fast'\]"):
        cuda_audit.read_sizes(page)
    page.write_text("def f():\n    SIZES = {'cuda': {}, 'cpu': {}}\n")
    with pytest.raises(cuda_audit.NoSizes, match="no SIZES literal at the top level"):
        cuda_audit.read_sizes(page)


def test_head_configurations_are_found_in_every_spelling_and_depth():
    sizes = {"embed": 512, "heads": 8, "bench": {"d_model": 512, "nhead": 8},
             "hf": {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128},
             "attention": {"heads": 16, "kv_heads": 4, "head_dim": 64}, "steps": 10}
    found = {h.where: h for h in cuda_audit.find_heads(sizes)}
    assert set(found) == {"top level", "bench", "hf", "attention"}
    assert [cuda_audit.head_faults(found[w])[0] for w in ("top level", "bench", "hf", "attention")] == \
        [64, 64, 128, 64]
    assert all(cuda_audit.head_faults(h)[1] == [] for h in found.values())


def test_the_dims_must_divide_evenly():
    head_dim, faults = cuda_audit.head_faults(cuda_audit.Heads("model", 100, 8, 3, None))
    assert faults[:2] == ["model: width 100 does not divide into 8 heads",
                          "model: 8 query heads do not divide into 3 key/value heads"]
    assert any("head size 12 on varlen" in f for f in faults), faults  # 100 // 8, not a multiple of 8
    assert cuda_audit.head_faults(cuda_audit.Heads("x", 512, 0, None, None))[1] == \
        ["x: heads 0 is not a positive integer"]
    assert cuda_audit.head_faults(cuda_audit.Heads("x", None, 8, None, None))[1][0].startswith(
        "x: 8 heads but no width")
    # FlashAttention's upper bound
    assert "at most 256, not 512" in " ".join(cuda_audit.head_faults(cuda_audit.Heads("x", 1024, 2, None, None))[1])


def test_the_corpus_is_read_once_and_checked_against_documents_and_requests():
    assert cuda_audit.corpus_lengths(2) is cuda_audit.corpus_lengths(2), "the corpus was read twice"
    available = len(cuda_audit.corpus_lengths(2))
    line, faults = cuda_audit.data_faults({"requests": 128, "corpus_documents": available + 1},
                                          {"min_chars": 2})
    assert faults == [f"corpus_documents {available + 1:,} > the {available:,} documents of at least 2 "
                      "characters the corpus has"], faults
    _, faults = cuda_audit.data_faults({"requests": 4000}, {"min_chars": 2})  # the default limit: 3,000 read
    assert faults == ["requests 4,000 > the 3,000 documents read (docstring_corpus(min_chars=2, limit=3000))"]
    # the sizes' own min_chars wins over the page's call, which wins over the default
    assert cuda_audit.data_faults({"train_tokens": 1, "min_chars": 200}, {"min_chars": 2})[0].startswith(
        "corpus (min_chars 200)")
    assert cuda_audit.data_faults({"train_tokens": 1})[0].startswith(
        f"corpus (min_chars {cuda_audit._CORPUS_DEFAULTS['min_chars']})")
    assert cuda_audit.data_faults({"steps": 3}) == ("no corpus sizes", [])


# --- every page --------------------------------------------------------------------------

def test_every_page_states_cuda_sizes_that_suit_the_gpu_machine():
    """Every ``tutorials/*.py``: a page added later is audited with no change
    here, and a page without a SIZES literal fails, named."""
    pages = cuda_audit.page_paths(REPO)
    assert {p.stem for p in pages} == {p.stem for p in (REPO / "tutorials").glob("*.py")} and pages
    results = cuda_audit.audit(pages)
    print("\n".join(line for r in results for line in r.lines))
    faults = [f for r in results for f in r.faults]
    assert not faults, f"{len(faults)} faults in the CUDA sizes of the pages:\n" + "\n".join(faults)


# --- the audit reaches nothing private of the library ------------------------------------

def patches(path) -> list[tuple[int, str]]:
    """Where a script reaches into the toolkit's packages or patches them:
    ``private_reaches`` (a ``_name`` imported from a module, or read from
    one), a ``_name`` read through any imported name of theirs, any
    ``setattr``/``delattr``, a ``getattr`` of a ``_name``, and a ``patch``
    of, or an assignment to an attribute of, one of their names or
    ``torch.Tensor``, or any ``.tolist``. ``(line, what)`` each."""
    tree = ast.parse(path.read_text())
    theirs = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names if (getattr(n, "module", None) or a.name).split(".")[0] in PACKAGES}

    def reaches(node):  # one of their names or torch.Tensor, an attribute of one, or a dotted name of theirs
        while isinstance(node, ast.Attribute) and ast.unparse(node) != "torch.Tensor":
            node = node.value
        return isinstance(node, ast.Attribute) or getattr(node, "id", None) in theirs | {"Tensor"} \
            or str(getattr(node, "value", "")).split(".")[0] in PACKAGES

    found = set(private_reaches(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name, args = ast.unparse(node.func), node.args
            if name in ("setattr", "delattr") or (name == "getattr" and len(args) > 1 and
                                                  str(getattr(args[1], "value", "")).startswith("_")) \
                    or (name.split(".")[-1] in ("patch", "object") and any(reaches(a) for a in args)):
                found.add((node.lineno, f"{name}(...)"))
        if isinstance(node, ast.Attribute) and reaches(node.value) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            found.add((node.lineno, ast.unparse(node)))
        targets = getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(node, ast.stmt) else []
        found |= {(node.lineno, f"{ast.unparse(t)} =") for t in targets
                  if isinstance(t, ast.Attribute) and (t.attr == "tolist" or reaches(t.value))}
    return sorted(found)


def test_the_audit_reaches_nothing_private_of_the_library():
    """The fake audit runs the library through its public API only: no
    private name, no patch of a module or of ``Tensor.tolist`` (issue 38)."""
    found = patches(SCRIPT)
    assert not found, "cuda_audit.py reaches into the library: " + "; ".join(f"line {n}: {w}" for n, w in found)


def test_the_reach_check_finds_each_kind(tmp_path):
    script = tmp_path / "reach.py"
    script.write_text("import unittest.mock\nimport ragged_toolkit.batches as batches\n"
                      "from ragged_toolkit.attention import flex, plan\nfrom ragged_toolkit.gpt import GPT\n\n\n"
                      "def f(t):\n    setattr(plan, 'offsets_from_lengths', None)\n    t.tolist = list\n"
                      "    flex.token_index = None\n    GPT._init = getattr(plan, '_lengths')\n"
                      "    unittest.mock.patch.object(batches, 'token_index')\n"
                      "    unittest.mock.patch('ragged_toolkit.attention.plan.check_offsets')\n"
                      "    torch.Tensor.item = None\n    unittest.mock.patch.object(torch.Tensor, 'tolist')\n"
                      "    return plan._lengths, GPT._weights, batches._cache\n")
    assert patches(script) == [
        (8, "setattr(...)"), (9, "t.tolist ="), (10, "flex.token_index ="), (11, "GPT._init"),
        (11, "GPT._init ="), (11, "getattr(...)"), (12, "unittest.mock.patch.object(...)"),
        (13, "unittest.mock.patch(...)"), (14, "torch.Tensor.item ="), (15, "unittest.mock.patch.object(...)"),
        (16, "GPT._weights"), (16, "batches._cache"), (16, "plan._lengths")]


# --- fake CUDA tensors -------------------------------------------------------------------

def _cuda_build_python() -> str:
    """A Python whose PyTorch is a CUDA build: this one, or CUDA_AUDIT_PYTHON
    (e.g. .venvs/torch-2.11.0/bin/python); skip, saying why, where there is none."""
    if torch.version.cuda is not None:
        return sys.executable
    other = os.environ.get("CUDA_AUDIT_PYTHON")
    if other:
        return other
    pytest.skip(f"{cuda_audit.fake_cuda_reason()}; set CUDA_AUDIT_PYTHON to a Python with one to run this here")


def _fake_audit(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([_cuda_build_python(), str(SCRIPT), "--fake", *args], capture_output=True, text=True,
                          env=env, timeout=1200)  # a hang guard only: about a minute a page on two busy cores
    print(proc.stdout, proc.stderr[-3000:])
    return proc


def test_fixture_models_run_on_fake_cuda_and_the_head_size_4_is_refused_there_too():
    proc = _fake_audit(*(str(PAGES / f"{n}.py") for n in ("good_page", "quick_head_size_4")))
    lines = proc.stdout.splitlines()
    assert "fake CUDA: not run" not in proc.stdout
    for mode in ("full", "quick"):
        for backend in ("varlen", "flex"):
            assert any(ln.strip().startswith(f"good_page ({mode}) model: {backend}: packed forwards of ")
                       for ln in lines), (mode, backend)
    assert any("quick_head_size_4 (full) model: flex: packed forwards" in ln for ln in lines)
    fake = [ln for ln in lines if ln.startswith("FAULT quick_head_size_4 (quick) model: ")]
    assert fake == [
        "FAULT quick_head_size_4 (quick) model: varlen: RuntimeError: ragged_attention: backend 'varlen' cannot run "
        "this here: FlashAttention needs a head size that is a multiple of 8, at most 256, not 4",
        "FAULT quick_head_size_4 (quick) model: flex: RuntimeError: ragged_attention: backend 'flex' cannot run "
        "this here: FlexAttention on CUDA needs a head size of at least 16, not 4"], fake
    assert proc.returncode == 1 and not any("good_page" in ln for ln in lines if ln.startswith("FAULT"))


def test_every_page_runs_its_models_on_fake_cuda():
    proc = _fake_audit()
    faults = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAULT")]
    assert proc.returncode == 0 and not faults, "\n".join(faults) or proc.stderr[-3000:]
