"""What the decoding page and the decision page rely on, without running
them: the toolkit pieces only they use (``compare_backends``'
``plan_per_call`` and ``profile``, ``Table``, ``draw_speedups``,
``generation_work``) do what the pages say. (Their CUDA sizes are checked
with every page's by ``tests/test_cuda_audit.py``.)"""

from __future__ import annotations

import json
import numpy as np
import pytest
import torch

from toolkit_api import MODULES
from toolkit_api import tk as toolkit


def test_compare_backends_plans_inside_the_call_when_asked(monkeypatch):
    compare = MODULES["ragged_site.measuring.compare"]
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


def test_draw_cache_memory_draws_each_stage_at_its_share_and_names_it():
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt
    from ragged_site.figures import draw_cache_memory

    fig = draw_cache_memory({"MHA": 8.0, "GQA": 2.0}, {"after prefill": 0.25, "at the end": 0.5})
    ax = fig.axes[0]
    assert [round(p.get_height(), 6) for p in ax.patches] == [8.0, 2.0, 2.0, 0.5, 4.0, 1.0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "allocated", "filled after prefill (25%)", "filled at the end (50%)"]
    assert [t.get_text() for t in ax.texts] == ["8.00", "2.00", "2.00", "0.50", "4.00", "1.00"]
    assert ax.get_title() and ax.get_ylabel().startswith("MiB")
    plt.close(fig)


def test_draw_speedup_cases_marks_each_bound_and_hatches_the_noisy():
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt
    from ragged_site.figures import draw_speedup_cases

    fig = draw_speedup_cases({"a": (0.5, 2.0, False), "b": (3.0, 6.0, True)}, "title")
    ax = fig.axes[0]
    assert [round(p.get_width(), 6) for p in ax.patches] == [0.5, 3.0]
    assert [p.get_hatch() for p in ax.patches] == [None, "//"]
    bounds = [line.get_xdata()[0] for line in ax.lines if line.get_linewidth() == 3]
    assert bounds == [2.0, 6.0]
    assert sorted(t.get_text() for t in fig.legends[0].get_texts()) == [
        "1x: no gain", "measured", "within noise", "work bound"]  # each once
    plt.close(fig)


def test_generation_work_counts_what_each_side_computes():
    work = toolkit.Work(per_token=10.0, per_pair=1.0)
    # prompts of 2 and 3 tokens, 3 new tokens each
    cached = 10 * (5 + 2 * 2) + (3 + 6) + (3 + 4) + (4 + 5)  # prefill, then steps seeing 3, 4 and 4, 5 keys
    again = 10 * (2 + 3 + 4 + 3 + 4 + 5) + (3 + 6 + 10 + 6 + 10 + 15)  # the whole history, three times
    assert toolkit.generation_work([2, 3], 3, work) == cached
    assert toolkit.generation_work([2, 3], 3, work, cache=False) == again


# --- the decision page's own paths and guide (ragged_site.decision) -------

def _batch(lengths=(3, 1, 5), heads=4, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = toolkit.offsets_from_lengths(list(lengths))
    q, k, v, grad = (torch.randn(sum(lengths), heads, head_dim, generator=gen) for _ in range(4))
    return q, k, v, grad, offsets


def test_compare_calls_checks_each_call_then_times_it_and_names_one_that_disagrees(capsys):
    compare = MODULES["ragged_site.measuring.compare"]
    x = torch.randn(4, 2, 16)
    calls = {("job", "same"): (lambda: x, lambda out: out.float(), x),
             "pair": (lambda: (x, 2 * x), lambda out: out.float(), (x, 2 * x))}
    results = compare.compare_calls(calls, dtype=torch.float32, min_run_time=0.01, profile=False)
    assert list(results) == list(calls) and all(isinstance(r, toolkit.Timing) for r in results.values())
    toolkit.print_timings(results)
    assert capsys.readouterr().out.splitlines()[0].startswith("  job, same ")  # a (job, path) name, joined
    wrong = {"wrong": (lambda: (x, x), lambda out: out.float(), (x, 2 * x))}
    with pytest.raises(AssertionError, match=r"wrong \(output 1\) disagrees with the reference"):
        compare.compare_calls(wrong, dtype=torch.float32, min_run_time=0.01, profile=False)


@pytest.mark.parametrize("paths", ["padded_paths", "one_row_paths"])
def test_the_dense_paths_match_the_reference_forward_backward_and_gqa(paths):
    q, k, v, grad, offsets = _batch()
    built = getattr(toolkit, paths)(q, k, v, offsets, grad, kv_heads=2)
    assert set(built) == {"inference", "training", "GQA"}
    q32, k32, v32 = (t.clone().requires_grad_() for t in (q, k, v))
    causal = toolkit.reference_attention(q32, k32, v32, offsets, is_causal=True)
    want = {"inference": (causal.detach(),), "training": torch.autograd.grad(causal, (q32, k32, v32), grad),
            "GQA": (toolkit.reference_attention(q, k[:, :2].contiguous(), v[:, :2].contiguous(), offsets,
                                                is_causal=True),)}
    for job, (call, packed) in built.items():
        got = call()
        for g, w in zip(got if job == "training" else (got,), want[job], strict=True):
            torch.testing.assert_close(packed(g), w, atol=1e-5, rtol=1e-5, msg=lambda m, job=job: f"{job}: {m}")


def test_the_padded_decoding_step_masks_the_rows_past_each_sequence():
    lengths, capacity, heads = torch.tensor([3, 1, 6]), 8, 4
    cache_offsets = torch.arange(4) * capacity
    k_cache, v_cache = torch.randn(3 * capacity, heads, 16), torch.randn(3 * capacity, heads, 16)
    k_cache[3:8], v_cache[3:8] = 1e3, 1e3  # the first sequence's rows past its 3 keys in use: they count for nothing
    q_one = torch.randn(3, heads, 16)
    k_rect, v_rect = (t.view(3, capacity, heads, 16).transpose(1, 2) for t in (k_cache, v_cache))
    call, packed = toolkit.padded_decoding(q_one, k_rect, v_rect, lengths)
    want = toolkit.reference_attention(q_one, k_cache, v_cache, torch.arange(4),
                                       cache_offsets, kv_used=lengths)
    torch.testing.assert_close(packed(call()), want, atol=1e-5, rtol=1e-5)


def test_alibi_as_a_score_function_and_as_biases_agree_with_the_reference():
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v, _, offsets = _batch(lengths=(5, 2, 9))
    slopes = torch.exp2(-8.0 * torch.arange(1, 5) / 4)
    want = toolkit.alibi_reference(q, k, v, offsets, slopes)
    # the bias: the penalty below the diagonal, -inf above it
    bias = toolkit.alibi_bias(slopes, 3)
    assert bias.shape == (4, 3, 3) and bias[0, 2, 0] == -2 * slopes[0] and bias[1, 0, 1] == float("-inf")
    # the score function, unfused, one sequence: the same as its bias
    a, b, c = (t[:5].transpose(0, 1)[None] for t in (q, k, v))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    flex = flex_attention(a, b, c, score_mod=lambda s, bb, h, i, j: toolkit.alibi_score_mod(slopes)(s, bb, h, i, j)
                          .masked_fill(~causal[i, j], float("-inf")))
    torch.testing.assert_close(flex[0].transpose(0, 1), want[:5], atol=1e-5, rtol=1e-5)
    paths = toolkit.alibi_paths(q, k, v, offsets, slopes)
    assert set(paths) == {"flex", "loop", "baseline"}
    for name in ("loop", "baseline"):  # flex compiles: the page runs it
        call, packed = paths[name]
        torch.testing.assert_close(packed(call()), want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_the_padded_serving_step_matches_attention_over_the_paged_cache():
    from ragged_toolkit.serving.engine import build_step

    cfg = toolkit.GPTConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=64, max_seq_len=64)
    requests = [toolkit.Request(0, [0] * 20, n_out=1, computed=12),  # a prompt chunk of 8
                toolkit.Request(1, [0] * 6, n_out=2, generated=[0], computed=6),  # a decode token
                toolkit.Request(2, [0] * 11, n_out=2, generated=[0], computed=11),
                toolkit.Request(3, [0] * 9, n_out=1, computed=5)]  # a prompt chunk of 4
    cache = toolkit.PagedKVCache(cfg, 13, 4, "cpu", torch.float32)  # 5 + 2 + 3 + 3 blocks
    for grown in range(4, 24, 4):  # side by side: the blocks of each request are not contiguous
        assert all(cache.reserve(r.rid, min(grown, r.length())) for r in requests)
    cache.k[0], cache.v[0] = torch.randn(*cache.k.shape[1:]), torch.randn(*cache.v.shape[1:])
    _, _, step = build_step(cache, [(r, r.pending()) for r in requests], "cpu", "gathered", "loop")
    q = torch.randn(int(step.q_offsets[-1]), 2, 16)
    rows = toolkit.paged_rows(step.block_table, step.kv_lengths, 4)
    want = toolkit.reference_attention(q, cache.k[0][rows], cache.v[0][rows], step.q_offsets,
                                       toolkit.offsets_from_lengths(step.kv_lengths), is_causal=True)
    padded = toolkit.PaddedServing(step, q)
    assert {n: g.tolist() for n, g in padded.groups.items()} == {"decode tokens": [False, True, True, False],
                                                               "prompt chunks": [True, False, False, True]}
    torch.testing.assert_close(padded.packed(padded()), want, atol=1e-5, rtol=1e-5)
    assert padded.pairs == 2 * 1 * 12 + 2 * 8 * 20  # the decode rows (2 x 1 x 12 keys), the chunks (2 x 8 x 20)


def _timing(ms, spread=0.1, kernels=""):
    return toolkit.Timing(ms, 2 * spread, q1_ms=ms - spread, q3_ms=ms + spread, runs=10, kernels=kernels)


def test_the_decision_guide_names_each_jobs_choice_speedup_and_the_paths_that_cannot(capsys):
    table = {"inference": {"baseline": _timing(8.0), "loop": _timing(2.0, kernels="CPU flash x3"),
                           "flex": _timing(4.0), "varlen": "needs CUDA"},
             "serving": {"baseline": _timing(1.0), "loop": _timing(2.0), "flex": _timing(2.05, 0.2)}}
    guide = toolkit.decision_guide(table, {"inference": 10.0, "serving": 2.0}, ("loop",),
                                   {"serving": "see the prefix cache"})
    out = capsys.readouterr().out
    assert "inference, loop against baseline: speedup 4.00x, work bound 10.00x, fraction of bound 0.40\n" in out
    # padding wins the serving job: the line is the fastest other path's
    assert "serving, loop against baseline: speedup 0.50x, work bound 2.00x, fraction of bound 0.25\n" in out
    assert guide.header == ["job", "chosen here", "against baseline", "then", "not here"]
    assert guide.rows[0] == ["inference", "loop, 2.00 ms\nkernels: CPU flash x3",
                             "speedup 4.00x\nwork bound 10.00x\nfraction 0.40", "flex, baseline", "varlen"]
    assert guide.rows[1][1:4] == ["baseline, 1.00 ms", "loop: speedup 0.50x\nwork bound 2.00x\nfraction 0.25",
                                  "loop, flex\nsee the prefix cache"]
    assert guide.css_class == "decision-guide"
    assert ("rules of thumb, one per job:\n"
            "  inference on CPU: use loop; if loop is not available here, flex.\n"
            "  serving on CPU: use the padded baseline; the fastest ragged path here is loop.\n") in out
    grid = toolkit.speedup_grid(table, ["baseline", "loop", "varlen"])
    np.testing.assert_allclose(grid, [[1.0, 1.0], [4.0, 0.5], [np.nan, np.nan]])


def test_the_rules_for_the_other_device_come_from_its_record_else_marked_not_measured(tmp_path):
    from ragged_site.decision import device_rules

    published = {"inference": ("use varlen.", "varlen_attn 0.22 ms against padded SDPA's 0.43 ms (cited)")}
    assert device_rules("cuda", published) == [
        "inference on CUDA, not measured here yet: use varlen.",
        "  varlen_attn 0.22 ms against padded SDPA's 0.43 ms (cited)",
        "other jobs on CUDA: not measured here yet, and no published figure is cited."]
    rule = {"kind": "rule", "line": "inference on CUDA: use varlen; if varlen is not available here, flex.",
            "device": "cuda"}
    runs = [{"mode": "quick", "status": "pass", "records": [dict(rule, line=rule["line"].replace("flex", "loop"))]},
            {"mode": "full", "status": "pass", "records": [rule, dict(rule, device="cpu")]}]
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"pages": {"which_attention_path": {"runs": runs}}}))
    assert device_rules("cuda", published, summary) == [rule["line"][:-1] + " (recorded GPU run)."]  # full size first
    runs[1]["status"] = "fail"
    summary.write_text(json.dumps({"pages": {"which_attention_path": {"runs": runs}}}))
    assert device_rules("cuda", published, summary) == [
        "inference on CUDA: use varlen; if varlen is not available here, loop (recorded GPU run)."]
