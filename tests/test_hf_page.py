"""The transformers page (tutorials/hf_packed_training.py): its minimum and
pin, the install cell of its notebook, the check-versions matrix for
transformers, the failure where transformers' attention interface changes,
and its equality checks failing where the registered function is replaced by
the stock ``sdpa`` one."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sitebuild import REPO

sys.path.insert(0, str(REPO / "sphinxext"))
sys.path.insert(0, str(REPO / "scripts"))
import check_versions  # noqa: E402
import downloads  # noqa: E402

STEM = "hf_packed_training"
PAGE = REPO / "tutorials" / f"{STEM}.py"
MINIMUMS = REPO / "requirements-minimum.txt"


def release(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("+")[0].split(".")[:3])


def page_constant(name: str) -> str:
    for node in ast.parse(PAGE.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{PAGE.name} sets no {name}")


def test_the_page_minimum_is_the_one_in_requirements_minimum_and_the_pin_is_newer():
    minimum = dict(downloads.minimums(MINIMUMS, STEM))["transformers"]
    assert minimum == page_constant("MINIMUM_TRANSFORMERS")
    assert release(check_versions.pins()["transformers"]) >= release(minimum)
    assert "transformers" not in dict(downloads.minimums(MINIMUMS)), \
        "transformers is a minimum of every notebook: it must be this page's only"


def _cell(stem):
    return downloads.install_cell(MINIMUMS, stem, "tk.whl", "https://site/tk.whl")


def test_only_this_pages_install_cell_installs_transformers():
    assert "transformers" not in _cell(None)
    assert _cell("ragged_batches_intro") == _cell(None)
    cell = _cell(STEM)
    assert f'"transformers>={page_constant("MINIMUM_TRANSFORMERS")}"' in cell and "==" not in cell


def test_the_notebook_of_this_page_installs_it_in_its_one_install_cell():
    nb = {"cells": [{"cell_type": "markdown", "source": "# Title\n", "metadata": {}},
                    {"cell_type": "code", "source": "print(1)", "metadata": {}, "outputs": []}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    out = downloads.notebook_for_download(nb, _cell(STEM))
    sources = [c["source"] for c in out["cells"]]
    assert sources == ["# Title\n", _cell(STEM), "print(1)"]
    assert downloads.notebook_for_download(out, _cell(STEM)) == out


def test_the_transformers_matrix_is_oldest_the_gpu_machines_pinned_newest():
    assert check_versions.imports_transformers(PAGE)
    assert not check_versions.imports_transformers(REPO / "tutorials" / "ragged_batches_intro.py")
    assert check_versions.transformers_matrix() == [
        page_constant("MINIMUM_TRANSFORMERS"), check_versions.GPU_MACHINE_TRANSFORMERS,
        check_versions.pins()["transformers"], check_versions.NEWEST_TRANSFORMERS]


def test_a_transformers_environment_is_its_own(tmp_path, monkeypatch):
    made = []

    def venv(cmd, **kw):
        made.append(cmd)
        Path(cmd[-1]).mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(check_versions.subprocess, "run", venv)
    monkeypatch.setattr(check_versions, "_pip", lambda python, *reqs: made.append(reqs))
    python = check_versions.environment("2.13.0", tmp_path, {"transformers": "4.54.0"})
    assert python == tmp_path / "torch-2.13.0-transformers-4.54.0" / "bin" / "python"
    assert "transformers==4.54.0" in made[-1] and "torch==2.13.0" in made[-1]
    pinned = check_versions.pins()["transformers"]
    python = check_versions.environment("2.13.0", tmp_path, {"transformers": pinned})
    assert python == tmp_path / "torch-2.13.0" / "bin" / "python", "the pin needs no environment of its own"
    assert f"transformers=={pinned}" in made[-1]


def test_the_transformers_record_is_its_own(tmp_path, monkeypatch):
    record = {"torch": "2.13.0", "transformers": "4.54.0", "pages": {STEM: {"result": "passed"}}}
    monkeypatch.setattr(check_versions, "check", lambda torch, pages, root, extra=None: dict(record))
    out, torch_record = tmp_path / "hf.json", tmp_path / "torch.json"
    assert check_versions.main(["--transformers", "4.54.0", "--pages", str(PAGE), "--record", str(torch_record),
                                "--transformers-record", str(out)]) == 0
    assert not torch_record.exists(), "a transformers run wrote the PyTorch record"
    written = json.loads(out.read_text())
    assert list(written["checked"]) == ["4.54.0"] and "transformers" in written["about"]


# --- the page itself ---------------------------------------------------------------

def page_until(marker: str) -> str:
    source = PAGE.read_text()
    assert marker in source, marker
    return source.split(marker)[0]


@pytest.fixture(scope="module")
def registered():
    """The page's cells up to its registration, run here: its namespace."""
    pytest.importorskip("transformers")
    env = {"TUTORIALS_QUICK": "1", "MPLBACKEND": "agg"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.path.insert(0, str(REPO / "tutorials"))
    try:
        namespace = {"__name__": "hf_page"}
        exec(compile(page_until("# A stock model, three ways"), str(PAGE), "exec"), namespace)
    finally:
        sys.path.remove(str(REPO / "tutorials"))
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return namespace


def test_the_registered_function_matches_sdpa_on_one_document(registered):
    import torch

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    module = torch.nn.Module()
    out, _ = registered["ragged_attention_forward"](module, q, k, v, None, scaling=8 ** -0.5,
                                                    position_ids=torch.arange(7)[None])
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(1, 2))  # (B, T, H, D)


@pytest.mark.parametrize("case", ["layout", "no boundaries", "boundaries"])
def test_a_changed_attention_interface_stops_with_one_clear_line(registered, case):
    import torch

    fn, module = registered["ragged_attention_forward"], torch.nn.Module()
    q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    if case == "layout":  # (B, T, H, D) where (B, H, T, D) is expected
        args, kw = (q.transpose(1, 2), kv.transpose(1, 2), kv.transpose(1, 2)), {"position_ids": torch.arange(6)[None]}
    elif case == "no boundaries":
        args, kw = (q, kv, kv), {}
    else:  # boundaries that do not cover the tokens
        args, kw = (q, kv, kv), {"cu_seq_lens_q": torch.tensor([0, 2, 4], dtype=torch.int32)}
    with pytest.raises(RuntimeError, match=r"transformers \S+ has changed its attention interface"):
        fn(module, *args, None, **kw)


def test_the_plan_passed_to_the_model_is_the_one_every_layer_uses(registered):
    """``ragged_plan``: built once per batch by the caller, read by each call
    instead of the boundaries; a plan of another batch is refused."""
    import torch

    fn, module = registered["ragged_attention_forward"], torch.nn.Module()
    q, kv = torch.randn(1, 4, 7, 16), torch.randn(1, 2, 7, 16)
    row = {"input_ids": torch.zeros(1, 7, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]])}
    plan = registered["plan_of"](row)
    assert plan.q_lengths == [3, 4] and plan.is_causal
    got, _ = fn(module, q, kv, kv, None, ragged_plan=plan)  # no boundaries in the call: the plan has them
    expected, _ = fn(module, q, kv, kv, None, position_ids=row["position_ids"])
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="plan describes 5 query rows"):
        fn(module, q, kv, kv, None, ragged_plan=registered["plan_batch"](torch.tensor([0, 5]), backend="loop",
                                                                      is_causal=True))


def test_group_by_length_batches_neighbours_in_length_and_every_document_once():
    """The length-grouped baseline (``ragged_toolkit.data.group_by_length``,
    the HF and GPT pages): every index once, batches of ``batch_size``, each
    window's batches cut from its documents sorted longest first, less
    padding than the documents as they came, the same batches for a seed."""
    import numpy as np
    from toolkit_api import tk

    lengths = np.random.default_rng(1).integers(1, 400, size=103).tolist()
    batches = tk.group_by_length(lengths, 8, 4, np.random.default_rng(0))
    assert sorted(i for b in batches for i in b) == list(range(103))
    assert sorted(len(b) for b in batches)[1:] == [8] * 12 and len(batches) == 13  # one short batch: 103 = 12 * 8 + 7
    for b in batches:
        window = b[0] // 32
        assert all(i // 32 == window for i in b), "a batch mixes two windows"
        mine = [lengths[i] for i in b]
        others = [lengths[i] for i in range(32 * window, min(32 * window + 32, 103)) if i not in b]
        assert all(n >= max(mine) or n <= min(mine) for n in others), "a batch's documents are not neighbours"
    padded = lambda bs: sum(len(b) * max(lengths[i] for i in b) for b in bs)  # noqa: E731
    naive = [list(range(i, min(i + 8, 103))) for i in range(0, 103, 8)]
    assert padded(batches) < padded(naive)
    assert batches == tk.group_by_length(lengths, 8, 4, np.random.default_rng(0))


def test_a_padding_mask_is_refused(registered):
    import torch

    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="takes packed rows"):
        registered["ragged_attention_forward"](torch.nn.Module(), q, q, q, torch.ones(1, 1, 6, 6, dtype=torch.bool))


@pytest.mark.parametrize("replaced", [False, True], ids=["registered", "replaced by sdpa"])
def test_the_equality_checks_fail_when_sdpa_replaces_the_registered_function(tmp_path, replaced):
    pytest.importorskip("transformers")
    source = page_until("# Training against what readers run")
    line = "AttentionInterface.register(NAME, ragged_attention_forward)"
    assert line in source
    if replaced:
        source = source.replace(line, 'AttentionInterface.register(NAME, ALL_ATTENTION_FUNCTIONS["sdpa"])')
    script = tmp_path / f"{STEM}.py"
    script.write_text(source)
    env = {**os.environ, "TUTORIALS_QUICK": "1", "MPLBACKEND": "agg",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tutorials"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    if not replaced:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert re.search(r"packed rows with 'sdpa' (attend across documents|keep documents apart)", proc.stdout)
        return
    assert proc.returncode != 0, "the checks passed with stock sdpa in place of ragged_attention"
    assert "AssertionError: ragged_toolkit differs from the padded model" in proc.stderr, proc.stderr[-3000:]


def test_gpu_check_skips_the_page_where_transformers_is_missing(tmp_path, monkeypatch, capsys):
    import gpu_check

    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    assert gpu_check.missing_packages(PAGE) == ["transformers"]
    assert gpu_check.main(["--allow-cpu", "--pages", STEM, "--out", str(tmp_path), "--stages", "quick,full"]) == 0
    out = capsys.readouterr().out
    assert f"SKIP {STEM}" in out and "needs transformers" in out and "1 skipped" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["pages"]) == 1, "a skipped page is listed once, not again at full size"
    assert summary["pages"][0]["passed"] is None and summary["pages"][0]["skipped"]


def test_the_transformers_record_holds_what_ran_and_no_machine_paths():
    text = check_versions.TRANSFORMERS_RECORD.read_text()
    assert "site-packages" not in text and str(REPO) not in text
    checked = json.loads(text)["checked"]
    assert set(checked) <= set(check_versions.transformers_matrix()), "a release outside the matrix"
    for version, rec in checked.items():
        assert rec["transformers"] == version and rec["pages"][STEM]["result"] in ("passed", "failed")
