"""Numbers a reader can trust (issue 16): a printed profile describes the
call that was timed, per call, at its steady state; FlexAttention compiles a
bounded number of graphs however many batch shapes it sees, and never falls
back to the unfused path; ``choose`` picks a winner only outside the noise."""

from __future__ import annotations

import re
import sys
import warnings

import numpy as np
import pytest
import torch

from toolkit_api import tk


def _loop_job(batch=48):
    """The which-path page's inference job on the loop backend: one SDPA call
    per sequence, each with a parallel region."""
    rng = np.random.default_rng(0)
    lengths = tk.sentence_lengths(rng, batch, 1.2)
    offsets = tk.offsets_from_lengths(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(int(lengths.sum()), 8, 32, generator=g) for _ in range(3))
    plan = tk.plan_batch(offsets, is_causal=True, backend="loop")

    def call():
        with torch.no_grad():
            return tk.ragged_attention(q, k, v, plan)

    return call


def test_the_profile_runs_with_the_threads_the_timing_ran_with():
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread here: nothing can differ")
    seen = []
    job = _loop_job(8)

    def call():
        seen.append(torch.get_num_threads())
        job()

    timing = tk.measure({"job": call}, min_run_time=0.05, profile=False)["job"]
    timed = set(seen)
    seen.clear()
    try:
        tk.where_time_goes(call, timing=timing)
    except TypeError:  # a where_time_goes that takes no timing
        tk.where_time_goes(call)
    assert set(seen) == timed, f"timed with {timed} threads, profiled with {set(seen)}"


def test_a_profile_is_per_call_at_the_steady_state_beside_its_timing():
    """What a profile prints is per call, of calls after warm-up, beside the
    median it describes: the operators it counts per call are those one call
    records (counted here apart from the toolkit), whatever number of calls
    it profiled; no duration is compared with a limit (a figure belongs on
    a page)."""
    from torch.profiler import ProfilerActivity, profile

    job = _loop_job()
    job()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        job()
    one_call = sum(e.count for e in prof.key_averages())
    timing = tk.measure({"job": job}, min_run_time=0.2, profile=False)["job"]
    result = tk.where_time_goes(job, timing=timing)
    assert result.calls >= 1 and result.events == pytest.approx(one_call), (result.calls, result.events, one_call)
    assert f"the timed median is {timing.median_ms:.2f} ms" in str(result), "the median is printed beside it"
    assert result.median_ms == timing.median_ms


# --- FlexAttention: a bounded number of compiles --------------------------------

def test_flex_compiles_a_few_graphs_for_many_batch_shapes_and_never_falls_back():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    rng = np.random.default_rng(1)
    token_counts, batches = set(), []
    while len(batches) < 20:  # 20 batches, each with its own token count
        lengths = torch.as_tensor(rng.integers(1, 40, size=int(rng.integers(10, 30))))
        n = int(lengths.sum())
        if 260 <= n <= 760 and n not in token_counts:
            token_counts.add(n)
            batches.append(lengths)
    before = counters["stats"]["unique_graphs"]
    kernel = tk.FlexKernel()
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for lengths in batches:
            offsets = tk.offsets_from_lengths(lengths)
            q = torch.randn(int(offsets[-1]), 4, 16, generator=g)
            k, v = (torch.randn(int(offsets[-1]), 2, 16, generator=g) for _ in range(2))
            out = tk.ragged_attention(q, k, v, tk.plan_batch(offsets, is_causal=True, backend="flex", flex=kernel))
            torch.testing.assert_close(
                out, tk.reference_attention(q, k, v, offsets, is_causal=True),
                atol=1e-5, rtol=1e-4)
    graphs = counters["stats"]["unique_graphs"] - before
    fallbacks = [str(w.message).splitlines()[0] for w in caught
                 if "without torch.compile" in str(w.message)
                 or "recompile_limit" in str(w.message)]
    assert not fallbacks, f"FlexAttention ran unfused: {fallbacks[:2]}"
    assert graphs <= 4, f"{graphs} graphs compiled for {len(batches)} token counts"


def test_compile_counter_counts_graphs_shapes_and_fallbacks():
    torch._dynamo.reset()
    with tk.compile_counter() as count:
        f = torch.compile(lambda x: x * 2, dynamic=False)
        for n in (3, 5):
            f(torch.ones(n))
            count.saw(n)
        warnings.warn("flex_attention called without torch.compile() is slow")
    assert count.graphs == 2 and count.shapes == {3, 5}
    assert len(count.fallbacks) == 1
    assert str(count) == "2 graphs compiled for 2 batch shapes, 0 graph breaks; 1 uncompiled fallbacks"


def test_flex_rows_is_a_few_sizes():
    sizes = {tk.flex_rows(n) for n in range(1, 8193)}
    assert len(sizes) == 20 and all(s % tk.FLEX_BLOCK == 0 for s in sizes)
    assert all(n <= tk.flex_rows(n) <= 1.25 * n + tk.FLEX_BLOCK for n in range(1, 8193))


# --- choices outside the noise --------------------------------------------------

def _t(q1, median, q3):
    return tk.Timing(median, q3 - q1, 0.0, q1_ms=q1, q3_ms=q3)


def test_choose_picks_a_winner_only_outside_the_noise(capsys):
    apart = {"a": _t(1.0, 1.1, 1.2), "b": _t(1.3, 1.4, 1.5), "c": "not here"}
    assert tk.choose(apart, "b", "job") == "a"
    assert "chosen a, outside the noise" in capsys.readouterr().out
    overlapping = {"a": _t(1.0, 1.1, 1.35), "b": _t(1.3, 1.4, 1.5)}
    assert tk.choose(overlapping, "b", "job") == "b"
    assert "within noise, chosen b (the default)" in capsys.readouterr().out
    # a default measurably slower than the tied pair is not picked
    tied = {"a": _t(1.0, 1.1, 1.35), "b": _t(1.3, 1.4, 1.5), "c": _t(3.0, 3.1, 3.2)}
    assert tk.choose(tied, ("c", "b"), "job") == "b"
    assert tk.choose({"a": _t(1.0, 1.1, 1.2)}, "b", "job") == "a"
    # apart, but from too few timed runs to tell: the default
    few = {"a": tk.Timing(1.1, 0.2, 0.0, q1_ms=1.0, q3_ms=1.2, runs=3),
           "b": tk.Timing(1.4, 0.2, 0.0, q1_ms=1.3, q3_ms=1.5, runs=3)}
    assert tk.choose(few, "b", "job") == "b"
    assert "too few timed runs" in capsys.readouterr().out
    assert tk.outside_noise(apart["a"], apart["b"])
    assert not tk.outside_noise(overlapping["a"], overlapping["b"])
