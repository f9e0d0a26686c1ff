"""The decoding page and the decision page, without running them: their
sizes suit CUDA's kernels in every mode, and the toolkit pieces only they
use (``compare_backends``' ``plan_per_call`` and ``profile``, ``Table``,
``draw_speedups``, ``generation_work``) do what the pages say."""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch

from sitebuild import REPO
from toolkit_api import MODULES
from toolkit_api import tk as toolkit

PAGES = {stem: REPO / "tutorials" / f"{stem}.py" for stem in ("ragged_decoding_kv_cache_gqa", "which_attention_path")}


def literal(node):
    """A literal, where ``dict(key=...)`` counts as one (CONTRIBUTING's form)."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "dict" and not node.args:
        return {kw.arg: literal(kw.value) for kw in node.keywords}
    if isinstance(node, ast.Dict):
        return {literal(key): literal(value) for key, value in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def page_sizes_literal(path):
    """The page's SIZES dict, read from its source without running it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SIZES" for t in node.targets):
            return literal(node.value)
    raise AssertionError(f"{path.name}: no literal SIZES dict")


def head_size(sizes):
    model = sizes.get("model")
    return model["dim"] // model["n_heads"] if model else sizes["head_dim"]


@pytest.mark.parametrize("stem", PAGES)
@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_cuda_sizes_suit_the_kernels(stem, quick):
    """Issue 35: on CUDA, quick mode kept 16 heads at width 64 (head size 4),
    which FlexAttention and FlashAttention refuse."""
    sizes = toolkit.page_sizes(page_sizes_literal(PAGES[stem]), "cuda", quick)
    d = head_size(sizes)
    assert d % 8 == 0 and d >= 16, f"{stem}: head size {d} on CUDA ({'quick' if quick else 'full'} mode)"
    for name in ("flex", "varlen"):  # what backend_support says of that size, without a GPU
        assert "head size" not in (toolkit.backend_support(name, "cpu", torch.bfloat16, head_dim=d) or "")


def test_compare_backends_plans_inside_the_call_when_asked(monkeypatch):
    compare = MODULES["ragged_toolkit.measuring.compare"]
    calls = []
    real = compare.plan_batch
    monkeypatch.setattr(compare, "plan_batch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    offsets = toolkit.offsets_from_lengths([3, 1, 4])
    q = torch.randn(8, 2, 16)
    for per_call in (False, True):
        calls.clear()
        results = compare.compare_backends(q, q, q, offsets, is_causal=True, backends=("loop",), min_run_time=0.01,
                                           plan_per_call=per_call, profile=False)
        timing = results["loop"]
        assert isinstance(timing, toolkit.Timing) and timing.kernels == "" and timing.peak_mib != timing.peak_mib
        assert (len(calls) > timing.runs) if per_call else len(calls) == 1, (per_call, len(calls), timing.runs)


def test_table_renders_every_cell_escaped_with_its_label():
    table = toolkit.Table(["job", "chosen"], [["decoding", "loop, 1.00 ms\nkernels: CPU flash x4"], ["a<b", "&"]],
                          css_class="decision-guide")
    html = table._repr_html_()
    assert html.startswith('<table class="figures-table decision-guide">') and html.count("<tr>") == 3
    assert '<td data-label="chosen">loop, 1.00 ms<br>kernels: CPU flash x4</td>' in html
    assert '<th data-label="job">a&lt;b</th>' in html and "&amp;" in html
    assert str(table).splitlines() == ["job       chosen", "decoding  loop, 1.00 ms", "          kernels: CPU flash x4",
                                       "a<b       &"]


def test_draw_speedups_writes_each_cell():
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    speedup = np.array([[1.0, 1.0], [2.5, np.nan], [0.04, 0.5]])
    fig = toolkit.draw_speedups(speedup, ["padded", "a", "b"], ["job 1", "job 2"], [5.0, 2.0], "title")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["1.0x", "1.0x", "2.5x\n(0.50)", "n/a", "0.04x\n(0.01)", "0.50x\n(0.25)"]
    plt.close(fig)


def test_generation_work_counts_what_each_side_computes():
    work = toolkit.Work(per_token=10.0, per_pair=1.0)
    # prompts of 2 and 3 tokens, 3 new tokens each
    cached = 10 * (5 + 2 * 2) + (3 + 6) + (3 + 4) + (4 + 5)  # prefill, then steps seeing 3, 4 and 4, 5 keys
    again = 10 * (2 + 3 + 4 + 3 + 4 + 5) + (3 + 6 + 10 + 6 + 10 + 15)  # the whole history, three times
    assert toolkit.generation_work([2, 3], 3, work) == cached
    assert toolkit.generation_work([2, 3], 3, work, cache=False) == again
