"""``ragged_toolkit.serving``: the paged cache's free list and block tables,
the schedulers, and the proof against decoding each request alone, which
must catch three planted bugs: a block table read one block off, a freed
block still in use, and a preempted request that resumes at the wrong
position."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

from toolkit_api import MODULES
from ragged_toolkit.attention.flex import FlexKernel
from ragged_toolkit.batches import offsets_from_lengths, token_index
from ragged_toolkit.serving import paged_attention, schedulers
from ragged_site.page import tolerances
from ragged_toolkit.gpt import GPT, GPTConfig
from ragged_toolkit.kv_cache import block_table_tensor, paged_rows, PagedKVCache
from ragged_toolkit.serving.requests import next_tokens, Request
from ragged_site.workloads import fresh_requests, poisson_arrivals, request_stream
from ragged_site.figures import draw_paged_cache
from ragged_toolkit.serving.engine import build_step, forward_step, step_logits
from ragged_site.serving.proof import TokenLogits, check_against_alone, logits_after, logits_alone
from ragged_site.serving.metrics import (draw_steps, draw_throughput_and_latency, latency_ms,
                                         ms_per_token, slot_bound, step_costs)
from ragged_toolkit.serving.schedulers import plan_continuous, plan_static, retire_batch
from ragged_toolkit.serving.server import serve, ServingRun, StepRecord, take_turns

CFG = GPTConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=256)
FLOAT32 = tolerances(torch.float32)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(CFG).eval()


@pytest.fixture(scope="module")
def stream():
    rng = np.random.default_rng(0)
    documents = [bytes(rng.integers(32, 127, size=int(n)).tolist()) for n in rng.integers(3, 40, 40)]
    return request_stream(documents, 24, rng, prompt_max=24, out_median=8, out_max=40)


def serve_all(model, requests, plan, n_blocks, block_size=4, check=True, **kw):
    """One run; the run and the logits that chose its tokens."""
    cache, logits = PagedKVCache(CFG, n_blocks, block_size, "cpu", torch.float32), TokenLogits()
    [result], = take_turns(lambda: serve(model, fresh_requests(requests), cache, plan, check=check,
                                         on_token=logits, **kw))
    return result, logits


def continuous(max_running=8, token_budget=16):
    return functools.partial(plan_continuous, max_running=max_running, token_budget=token_budget)


def test_the_stream_opens_documents_and_draws_long_tailed_outputs():
    documents = [f"{n:02d}".encode() + b"x" * n for n in range(60)]  # distinct openings
    requests = request_stream(documents, 50, np.random.default_rng(1), prompt_max=8, out_median=6,
                              out_max=30)
    assert len({bytes(r.prompt) for r in requests}) == 50, "two requests share a document"
    assert all(bytes(r.prompt) in {d[:8] for d in documents} for r in requests)
    outs = np.array([r.n_out for r in requests])
    assert outs.min() >= 1 and outs.max() <= 30 and outs.mean() > np.median(outs), "not long-tailed"
    again = request_stream(documents, 50, np.random.default_rng(1), prompt_max=8, out_median=6,
                           out_max=30)
    assert [(r.prompt, r.n_out) for r in again] == [(r.prompt, r.n_out) for r in requests]
    arrivals = poisson_arrivals(np.random.default_rng(2), 2000, rate=4.0)
    assert np.all(np.diff(arrivals) > 0) and 1 / 4.4 < np.diff(arrivals).mean() < 1 / 3.6


# --- the paged cache ---------------------------------------------------------------


def test_blocks_come_from_the_free_list_and_go_back():
    cache = PagedKVCache(CFG, 6, 4, "cpu", torch.float32)
    assert cache.reserve(0, 6) and cache.reserve(1, 9)
    assert cache.tables == {0: [0, 1], 1: [2, 3, 4]} and cache.free == [5]
    assert not cache.reserve(2, 8), "two blocks were granted from a free list of one"
    assert 2 not in cache.tables and cache.free == [5]
    cache.release(0)
    assert cache.reserve(2, 8) and cache.tables[2] == [0, 1]
    cache.check()
    assert cache.slots(1, [0, 3, 4, 8]) == [8, 11, 12, 16]


def test_the_check_names_a_block_held_twice_or_lost():
    cache = PagedKVCache(CFG, 4, 4, "cpu", torch.float32)
    cache.reserve(0, 8)
    cache.free.append(cache.tables[0][1])  # block 1: free and held
    with pytest.raises(RuntimeError, match="block 1 is in the free list and in the table of request 0"):
        cache.check()
    cache.free.remove(1)
    cache.tables[0].pop()  # block 1: neither
    with pytest.raises(RuntimeError, match="1 blocks are neither free nor held"):
        cache.check()


def test_paged_rows_read_each_key_through_its_block_table():
    cache = PagedKVCache(CFG, 8, 4, "cpu", torch.float32)
    for rid, n in ((0, 3), (1, 9), (2, 5)):
        cache.reserve(rid, n)
    table = block_table_tensor(cache, [2, 1], "cpu")
    assert table.dtype == torch.int32 and table.tolist() == [[4, 5, 0], [1, 2, 3]]
    rows = paged_rows(table, torch.tensor([5, 9]), 4)
    assert rows.tolist() == [16, 17, 18, 19, 20] + [4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert rows.tolist() == cache.slots(2, range(5)) + cache.slots(1, range(9))


def test_a_step_packs_each_token_at_its_position_and_row():
    """``build_step``'s tensor arithmetic against each request's rows one token at a time."""
    cache = PagedKVCache(CFG, 12, 4, "cpu", torch.float32)
    chunk = Request(0, list(range(7)), 3)  # its first 5 prompt tokens
    decode = Request(1, list(range(10, 19)), 3, generated=[5, 6], computed=10)  # its last token, 6
    idle = Request(2, list(range(3)), 2, computed=3)  # an idle slot: one padding token
    for req, n in ((chunk, 5), (decode, 11), (idle, 4)):
        cache.reserve(req.rid, n)
    cache.reserve(3, 8)  # another request's blocks between them
    cache.reserve(2, 8)
    work = [(chunk, 5), (decode, 1), (idle, 0)]
    tokens, positions, layout = build_step(cache, work, "cpu", "gathered", "loop")
    assert tokens.tolist() == [0, 1, 2, 3, 4, 6, 0]
    assert positions.tolist() == [0, 1, 2, 3, 4, 10, 3]
    assert layout.slots.tolist() == cache.slots(0, range(5)) + cache.slots(1, [10]) + cache.slots(2, [3])
    assert layout.kv_lengths.tolist() == [5, 11, 4] and layout.q_offsets.tolist() == [0, 5, 6, 7]
    assert (layout.max_q, layout.max_kv) == (5, 11)
    assert next_tokens(decode, 8, 3) == [18, 5, 6] and next_tokens(decode, 0, 2) == [10, 11]
    assert next_tokens(Request(9, [1, 2], 5, generated=[3, 4, 5, 6]), 0, 1) == [1], "the answer read before its prompt ended"
    cache.release(0)
    cache.reserve(0, 4)
    with pytest.raises(RuntimeError, match="request 0 writes position 4, but its 1 blocks hold 4 tokens"):
        build_step(cache, work, "cpu", "gathered", "loop")


# --- the schedulers, proved against decoding each request alone ---------------------------


def test_continuous_batching_preempts_and_equals_decoding_alone(model, stream):
    run, logits = serve_all(model, stream, continuous(), n_blocks=14)
    preempted = sum(r.preempted for r in run.requests)
    assert preempted > 0, "the cache was never full: nothing tested preemption"
    assert all(r.done() for r in run.requests) and len(run.requests) == len(stream)
    assert max(s.prefill + s.decode for s in run.steps) <= 16, "a step went over the token budget"
    assert max(s.running for s in run.steps) <= 8
    assert any(0 < s.prefill and s.decode for s in run.steps), "no step mixed prompt and decode tokens"
    worst, ties = check_against_alone(model, run.requests, FLOAT32, logits)
    assert worst < 1e-4 and ties == 0


def test_long_prompts_are_chunked_under_the_budget(model, stream):
    steps = []
    run, logits = serve_all(model, stream[:4], continuous(token_budget=6), n_blocks=64,
                    observe=lambda i, running, cache: steps.append({r.rid: r.computed for r in running}))
    longest = max(stream[:4], key=lambda r: len(r.prompt))
    assert len(longest.prompt) > 6
    computed = [s[longest.rid] for s in steps if longest.rid in s]
    assert computed[0] < len(longest.prompt), "the long prompt went in one step"
    check_against_alone(model, run.requests, FLOAT32, logits)


def test_static_batches_idle_until_their_longest_request_is_done(model, stream):
    plan = functools.partial(plan_static, batch_size=8, reserve=40)
    run, logits = serve_all(model, stream, plan, n_blocks=8 * 16, retire_step=retire_batch)
    longest = [max(r.n_out for r in stream[i:i + 8]) for i in range(0, len(stream), 8)]
    assert len(run.steps) == sum(longest), "a static batch took other than its longest request's steps"
    assert slot_bound(run) == pytest.approx(8 * sum(longest) / sum(r.n_out for r in stream))
    assert {s.running for s in run.steps} == {8}, "a slot was given back before its batch ended"
    check_against_alone(model, run.requests, FLOAT32, logits)


def test_static_and_continuous_runs_take_turns(model, stream):
    order = []

    def noting(name, plan):
        return lambda *args: order.append(name) or plan(*args)

    cache = lambda: PagedKVCache(CFG, 8 * 16, 4, "cpu", torch.float32)  # noqa: E731
    static = functools.partial(plan_static, batch_size=8, reserve=40)
    a, b = take_turns(lambda: serve(model, fresh_requests(stream), cache(), noting("c", continuous())),
                      lambda: serve(model, fresh_requests(stream), cache(), noting("s", static), retire_batch))
    assert order[:6] == ["c", "s"] * 3
    assert len(b) == 1 and len(a) == (len(b[0].steps) + 1) // (len(a[0].steps) + 1), \
        "the shorter run did not start again (one turn to end, one step a turn) until the longer ended"


def test_take_turns_repeats_each_run_until_it_ended_as_often_as_asked(model, stream):
    cache = lambda: PagedKVCache(CFG, 64, 4, "cpu", torch.float32)  # noqa: E731
    short, long = stream[:2], stream[:6]
    a, b = take_turns(lambda: serve(model, fresh_requests(short), cache(), continuous()),
                      lambda: serve(model, fresh_requests(long), cache(), continuous()), runs=3)
    assert len(b) == 3 and len(a) >= 3, (len(a), len(b))
    assert all(len(run.requests) == 2 and all(r.done() for r in run.requests) for run in a)


def test_online_arrivals_wait_for_the_clock(model, stream):
    arrivals = np.arange(len(stream)) * 10.0  # far apart: each request runs alone
    run, logits = serve_all(model, fresh_requests(stream, arrivals), continuous(), n_blocks=64)
    assert max(s.running for s in run.steps) == 1
    assert all(r.first_token_s > r.arrival for r in run.requests)
    lat = latency_ms(run.requests)
    assert 0 < lat["ttft"][0] <= lat["ttft"][1] and 0 < lat["tpot"][0] <= lat["tpot"][1]


def test_latency_and_slot_bound_by_hand():
    a = Request(0, [1], 3, arrival=1.0, generated=[1, 2, 3], first_token_s=1.5, finish_s=2.5)
    b = Request(1, [1], 1, arrival=2.0, generated=[1], first_token_s=2.25, finish_s=2.25)
    lat = latency_ms([a, b])
    assert lat["ttft"][0] == pytest.approx(375.0)  # the median of 500 and 250 ms
    assert lat["tpot"] == pytest.approx((500.0, 500.0))  # b has one token: no time per token


def test_the_spread_of_throughput_over_runs_by_hand():
    def run(seconds, tokens):  # one step of ``seconds``, one request of ``tokens``
        return ServingRun([Request(0, [1], tokens)], [StepRecord(seconds, 1, tokens, 1, 0, 1, 1)])

    spread = ms_per_token([run(1.0, 100), run(2.0, 100), run(3.0, 100), run(4.0, 100), run(5.0, 100)])
    assert spread.runs == 5 and spread.median_ms == pytest.approx(30.0)  # 3 s over 100 tokens
    assert (spread.q1_ms, spread.q3_ms) == pytest.approx((20.0, 40.0))


def test_costs_a_slot_bound_leaves_out_by_hand():
    def step(seconds, prefill, running, waiting):
        return StepRecord(seconds, prefill, running, running, waiting, 0, 0)

    steps = [step(3.0, 10, 4, 2), step(1.0, 0, 4, 2), step(1.2, 0, 4, 1), step(0.8, 0, 4, 3),  # full
             step(2.0, 5, 2, 0), step(0.5, 0, 2, 0)]  # the tail: fewer running than 4, none waiting
    cost = step_costs(steps, slots=4)
    assert cost["decode_step_s"] == pytest.approx(1.0)  # the median of 1.0, 1.2 and 0.8: neither mixed nor tail
    assert (cost["tail_steps"], cost["mixed_steps"], cost["prompt_tokens"]) == (2, 2, 15)
    assert cost["tail_seconds"] == pytest.approx(2.5) and cost["seconds"] == pytest.approx(8.5)
    assert cost["prompt_seconds"] == pytest.approx(3.0 + 2.0 - 2 * 1.0)


def test_the_logits_of_a_step_and_of_decoding_alone(model, stream):
    """``logits_after`` is the row of ``logits_alone`` that chose each token;
    ``step_logits`` gives what ``forward_step`` chooses with and changes no request."""
    run, logits = serve_all(model, stream[:3], continuous(), n_blocks=64)
    req = run.requests[0]
    alone = logits_alone(model, req)
    for i in (0, len(req.generated) - 1):
        torch.testing.assert_close(logits_after(model, req.prompt + req.generated[:i]), alone[i], **FLOAT32)
    cache = PagedKVCache(CFG, 16, 4, "cpu", torch.float32)
    requests = fresh_requests(stream[:2])
    work = [(r, len(r.prompt)) for r in requests]
    assert all(cache.reserve(r.rid, len(r.prompt)) for r in requests)
    logits = step_logits(model, cache, work)
    assert logits.shape == (2, CFG.vocab_size) and all(r.computed == 0 and not r.generated for r in requests)
    seen = TokenLogits()
    forward_step(model, cache, work, on_token=seen)
    assert [r.generated for r in requests] == [[t] for t in logits.argmax(-1).tolist()]
    torch.testing.assert_close(torch.cat([seen.of(r) for r in requests]), logits, **FLOAT32)
    for r in requests:
        torch.testing.assert_close(logits_after(model, r.prompt), seen.of(r)[0], **FLOAT32)
        assert not any(isinstance(v, torch.Tensor) or isinstance(v, list) and any(isinstance(x, torch.Tensor)
                       for x in v) for v in vars(r).values()), "a request keeps tensors: only proofs need logits"
    with pytest.raises(KeyError, match="request 0: no logits recorded"):
        TokenLogits().of(requests[0])


def test_the_pictures_draw_each_step_run_and_block(model, stream):
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    runs = {name: [serve_all(model, stream[:6], continuous(max_running=m), n_blocks=64)[0] for _ in range(2)]
            for name, m in (("continuous", 8), ("one at a time", 1))}
    steps = runs["continuous"][0].steps
    fig = draw_steps(steps, 16, "title")
    decode_bars, prompt_bars = fig.axes[0].containers
    assert [b.get_height() for b in decode_bars] == [s.decode for s in steps]
    assert [b.get_height() for b in prompt_bars] == [s.prefill for s in steps]
    plt.close(fig)
    latency = {name: latency_ms(each[0].requests) for name, each in runs.items()}
    fig = draw_throughput_and_latency(runs, latency, rate=3.0)
    points = [line.get_ydata() for line in fig.axes[0].lines[::2]]  # a point per run, then the median's bar
    assert [list(p) for p in points] == [[sum(r.n_out for r in run.requests) / sum(s.seconds for s in run.steps)
                                          for run in each] for each in runs.values()]
    assert len(fig.axes[1].patches) == 4 * len(latency) and fig.axes[1].get_title() == "Arrivals at 3.0 requests/s"
    plt.close(fig)
    cache = PagedKVCache(CFG, 8, 4, "cpu", torch.float32)
    for rid, n in ((0, 6), (1, 3), (2, 9)):
        cache.reserve(rid, n)
    fig = draw_paged_cache(cache.tables, cache.free, cache.n_blocks, cache.block_size, {0: 6, 1: 3, 2: 9}, shown=2)
    top, tables = fig.axes
    assert [t.get_text() for t in top.texts] == ["0", "1", "", "0", "1", "2", "", ""]  # request 2, then 0
    assert [t.get_text() for t in tables.texts] == ["3", "4", "5", "0", "1"]
    assert [t.get_text() for t in tables.get_yticklabels()] == ["request 2, 9 keys", "request 0, 6 keys"]
    assert "1 others (gray), 2 free (white)" in top.get_title()
    plt.close(fig)


def test_bfloat16_logits_stay_within_the_stated_tolerance(model, stream):
    low = GPT(CFG).eval()
    low.load_state_dict(model.state_dict())
    low = low.to(torch.bfloat16)
    cache = PagedKVCache(CFG, 14, 4, "cpu", torch.bfloat16)
    logits = TokenLogits()
    [run], = take_turns(lambda: serve(low, fresh_requests(stream[:8]), cache, continuous(), on_token=logits))
    reference = GPT(CFG).eval()
    reference.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
    worst, _ = check_against_alone(reference, run.requests, dict(atol=0.1, rtol=0.05), logits)
    assert worst > 0, "bfloat16 logits equal float32 ones: the low precision did not run"


def test_flex_reads_the_paged_cache_as_the_gathered_path_does(model, stream):
    flex = FlexKernel()
    runs = [serve_all(model, stream[:6], continuous(), n_blocks=64, block_size=16, path=path, flex=flex)
            for path in ("gathered", "flex")]
    (gathered, gathered_logits), (flex, flex_logits) = runs
    for a, b in zip(gathered.requests, flex.requests):
        torch.testing.assert_close(flex_logits.of(b), gathered_logits.of(a), **FLOAT32)
    check_against_alone(model, flex.requests, FLOAT32, flex_logits)


def test_varlen_says_why_it_cannot_read_the_cache(monkeypatch):
    support = paged_attention.paged_varlen_support
    assert "CUDA" in support("cpu", torch.bfloat16, 256)
    monkeypatch.setattr(paged_attention, "backend_support", lambda *a, **k: None)
    varlen = MODULES["ragged_toolkit.attention.varlen"]
    monkeypatch.setattr(varlen, "VARLEN_KEYWORDS", frozenset({"window_size", "enable_gqa", "seqused_k"}))
    assert support("cuda", torch.bfloat16, 256) == "this release's varlen_attn has no block_table, num_splits"
    monkeypatch.setattr(varlen, "VARLEN_KEYWORDS",
                        frozenset({"window_size", "enable_gqa", "seqused_k", "block_table", "num_splits"}))
    assert "blocks of 16 rows: FlashAttention's paged kernel needs a multiple of 256" == support("cuda", torch.bfloat16, 16)
    assert support("cuda", torch.bfloat16, 256) is None


def test_bad_input_is_named(model, stream):
    with pytest.raises(ValueError, match="30 requests need 30 documents; the corpus has 2"):
        request_stream([b"ab", b"cd"], 30, np.random.default_rng(0), prompt_max=4, out_median=2, out_max=4)
    longest = max(stream, key=lambda r: len(r.prompt) + r.n_out)
    total = len(longest.prompt) + longest.n_out
    with pytest.raises(ValueError, match=f"request {longest.rid}: {total} tokens need {-(-total // 4)} blocks "
                                         "of 4 rows; the whole cache has 2"):
        serve_all(model, [longest], continuous(), n_blocks=2)
    with pytest.raises(RuntimeError, match="no room for a static batch of 8"):  # each fits alone, not 8
        serve_all(model, stream, functools.partial(plan_static, batch_size=8, reserve=40), n_blocks=16,
                  retire_step=retire_batch)


# --- requests the server cannot serve: refused on arrival, by name -----------------------

BAD_REQUESTS = {  # what is wrong -> (the request, the error it gets), on a cache of 20 blocks of 4 rows
    "empty prompt": (Request(99, [], 4), "request 99: empty prompt; a request needs at least one prompt token"),
    "past the model's positions": (Request(99, [7] * 200, 57), "request 99: prompt of 200 tokens plus 57 "
                                   "output tokens is 257 positions; the model has 256 (max_seq_len)"),
    "token outside the vocabulary": (Request(99, [5, 256, 7], 4), "request 99: token id 256 at prompt "
                                     "position 1 is outside the vocabulary (ids 0 to 255)"),
    "no output": (Request(99, [5, 6], 0), "request 99: output length 0; a request generates at least one token"),
    "larger than the whole cache": (Request(99, [7] * 60, 40), "request 99: 100 tokens need 25 blocks of 4 "
                                    "rows; the whole cache has 20"),
}


@pytest.mark.parametrize("what", BAD_REQUESTS)
def test_a_request_the_server_cannot_serve_is_refused_before_any_step(model, stream, what):
    bad, message = BAD_REQUESTS[what]
    steps = []
    with pytest.raises(ValueError, match=re.escape(message)):
        serve_all(model, [*stream[:4], bad], continuous(), n_blocks=20,
                  observe=lambda i, running, cache: steps.append(i))
    assert steps == [], f"{what}: a step ran before the request was refused"


@pytest.mark.parametrize("what", BAD_REQUESTS)
def test_a_refused_arrival_leaves_the_running_requests_undisturbed(model, stream, what):
    bad, message = BAD_REQUESTS[what]
    late = fresh_requests([bad], [1e-9])  # arrives once the first step has run
    refused, running_then = [], []

    def note(request, error):
        refused.append((request.rid, str(error), len(running_then)))  # steps run before the refusal

    cache = PagedKVCache(CFG, 20, 4, "cpu", torch.float32)
    logits = TokenLogits()
    [run], = take_turns(lambda: serve(model, [*fresh_requests(stream[:4]), *late], cache, continuous(),
                                      check=True, on_refused=note, on_token=logits,
                                      observe=lambda i, running, c: running_then.append(len(running))))
    assert len(refused) == 1 and refused[0][0] == 99, f"{what}: not refused"
    assert refused[0][1] == message
    assert [r for r, _ in run.refused] == late and 99 not in cache.tables
    assert refused[0][2] >= 1 and running_then[refused[0][2] - 1] > 0, "nothing was running when it came"
    assert sorted(r.rid for r in run.requests) == [r.rid for r in stream[:4]]
    worst, _ = check_against_alone(model, run.requests, FLOAT32, logits)  # each as if alone: undisturbed
    assert worst < 1e-4


# --- three planted bugs, each caught by the proof ----------------------------------------


def test_planted_off_by_one_block_index_fails(model, stream, monkeypatch):
    def rows_one_block_off(block_table, kv_lengths, block_size):
        seq, pos = token_index(offsets_from_lengths(kv_lengths))
        return block_table[seq, pos // block_size - 1].long() * block_size + pos % block_size  # planted: - 1

    monkeypatch.setattr(paged_attention, "paged_rows", rows_one_block_off)
    run, logits = serve_all(model, stream, continuous(), n_blocks=64)
    with pytest.raises(AssertionError, match="differ from decoding it alone"):
        check_against_alone(model, run.requests, FLOAT32, logits)


def test_planted_freed_block_still_in_use_fails(model, stream, monkeypatch):
    def release_keeping_the_table(self, rid):
        self.free.extend(reversed(self.tables.get(rid, [])))  # planted: the table still names them

    monkeypatch.setattr(PagedKVCache, "release", release_keeping_the_table)
    run, logits = serve_all(model, stream, continuous(), n_blocks=14, check=False)
    assert sum(r.preempted for r in run.requests) > 0
    with pytest.raises(AssertionError, match="differ from decoding it alone"):
        check_against_alone(model, run.requests, FLOAT32, logits)
    with pytest.raises(RuntimeError, match=r"block \d+ is in the free list and in the table of request"):
        serve_all(model, stream, continuous(), n_blocks=14, check=True)


def test_planted_resume_at_the_wrong_position_fails(model, stream, monkeypatch):
    def preempt_keeping_the_position(req, cache):
        cache.release(req.rid)
        req.computed = req.length() - 1  # planted: resumes as if its keys were still cached
        req.preempted += 1

    monkeypatch.setattr(schedulers, "_preempt", preempt_keeping_the_position)
    run, logits = serve_all(model, stream, continuous(), n_blocks=14)
    assert sum(r.preempted for r in run.requests) > 0
    with pytest.raises(AssertionError, match="differ from decoding it alone"):
        check_against_alone(model, run.requests, FLOAT32, logits)
