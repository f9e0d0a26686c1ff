"""``ragged_toolkit.serving.prefix_cache`` and the modules of the shared-prompts
page: block keys (a chained hash of fixed size, a hit checked against its
tokens and parent), reference counts, the idle list and eviction, admission
taking the cached prefix; every request served with the cache equal to
decoding it alone, under eviction and preemption and with colliding hashes;
four planted faults, each caught (a hit not checked against its parent or
its tokens, a block evicted while a request reads it, a request writing into
a shared block); shared-prefix attention against a
float64 reference; the workloads and the repeated runs, with and without
the cache."""

from __future__ import annotations

import functools

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from ragged_site.page import tolerances
from ragged_toolkit.gpt import GPT, GPTConfig
from ragged_toolkit.kv_cache import PagedKVCache
from ragged_toolkit.serving.paged_attention import gathered_attention
from ragged_toolkit.serving.prefix_cache import PrefixCache, PrefixStats, block_hash, retire_caching
from ragged_site.serving.prefix_tree import MostSharedTree, cached_tree, tree_rows
from ragged_site.serving.proof import TokenLogits, check_against_alone
from ragged_toolkit.serving.requests import Request
from ragged_site.workloads import fresh_requests
from ragged_site.serving.runs import (draw_trace, prompt_token_seconds, prove_every_run,
                                      skipping_bound, with_and_without)
from ragged_toolkit.serving.schedulers import plan_continuous
from ragged_toolkit.serving.server import StepRecord, ServingRun, serve, take_turns
from ragged_toolkit.serving.shared_prefix_attention import _attention_lse, _merge_by_lse, plan_shared_prefix, shared_prefix_attention
from ragged_site.serving.shared_prompts import rows_read, shared_prefix_step
from ragged_site.serving.shared_prompts import (conversation_stream, greedy_answers,
                                                reusable_tokens, system_prompt_stream)

CFG = GPTConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=256)
FLOAT32 = tolerances(torch.float32)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(CFG).eval()


@pytest.fixture(scope="module")
def documents():
    rng = np.random.default_rng(0)
    return [bytes(rng.integers(32, 127, size=int(n)).tolist()) for n in rng.integers(3, 60, 80)]


def serve_one(model, requests, n_blocks, cache_type=PrefixCache, block_size=4, budget=16, running=6,
              check=True, arrivals=None, **cache_options):
    """One run of the continuous scheduler with a prefix cache; the run, its cache (whose
    ``stats`` counted the run) and the logits that chose each token."""
    cache = cache_type(CFG, n_blocks, block_size, "cpu", torch.float32, stats=PrefixStats(), **cache_options)
    plan, logits = functools.partial(plan_continuous, max_running=running, token_budget=budget), TokenLogits()
    [[run]] = take_turns(lambda: serve(model, fresh_requests(requests, arrivals), cache, plan,
                                       retire_caching, check=check, on_token=logits))
    return run, cache, logits


def shared_stream(documents, n=16):
    """Requests behind two shared prefixes of 10 tokens (two full blocks of 4 and a partial one)."""
    rng = np.random.default_rng(1)
    return system_prompt_stream(documents, n, rng, systems=2, system_len=10, user_max=9,
                                out_median=6, out_max=14)


# --- the cache's bookkeeping -------------------------------------------------------


def test_a_key_names_the_whole_prefix_in_one_number():
    a = block_hash(block_hash(None, [1, 2]), [3, 4])
    assert a == block_hash(block_hash(None, [1, 2]), [3, 4]) and isinstance(a, int)
    assert a != block_hash(block_hash(None, [9, 2]), [3, 4]), "the parent is part of the key"
    assert a != block_hash(None, [3, 4]), "the same tokens at position 0 have another key"


def test_keying_a_prompt_reads_each_token_once():
    """A block's key costs its own tokens, whatever its depth: the cost of a
    prompt's keys grows with its length, not with the square of its blocks."""
    read = []

    def counting_hash(parent, tokens):
        read.append((len(tokens), parent is None or isinstance(parent, int)))
        return block_hash(parent, tokens)

    cache = PrefixCache(CFG, 40, 4, "cpu", torch.float32, block_hash=counting_hash)
    req = Request(0, list(range(100)), 1)
    cache.take_prefix(0, req.prompt)  # a miss at its first block
    cache.reserve(0, 100)
    req.computed = 100
    cache.note_computed(req)
    assert cache.take_prefix(1, list(range(101))) == 100
    assert read == [(4, True)] * (1 + 25 + 25), "a key read more than its block or a parent that is not a number"  # miss, key 25, find 25
    cache.check()
    deep = PrefixCache(CFG, 1600, 1, "cpu", torch.float32)  # 1,500 blocks deep: nested keys would recurse
    req = Request(0, list(range(1500)), 1)
    deep.take_prefix(0, req.prompt)
    deep.reserve(0, 1500)
    req.computed = 1500
    deep.note_computed(req)
    assert deep.take_prefix(1, req.prompt + [7]) == 1500


def test_admission_takes_full_blocks_and_leaves_a_token_to_compute():
    cache = PrefixCache(CFG, 8, 4, "cpu", torch.float32)
    a = Request(0, list(range(8)), 1)
    assert cache.take_prefix(0, a.prompt) == 0 and cache.reserve(0, 8)
    a.computed = 8
    cache.note_computed(a)
    assert sorted(cache.key_of) == cache.tables[0] == [0, 1]
    assert cache.take_prefix(1, list(range(8))) == 4, "the whole prompt was taken: no logits to choose with"
    assert cache.take_prefix(2, list(range(7)) + [99, 5]) == 4, "a block that differs was taken"
    assert cache.take_prefix(3, list(range(6))) == 4, "a partial block was shared"
    assert cache.refs[:2] == [4, 1] and cache.tables[1] == cache.tables[2] == cache.tables[3] == [0]
    cache.check()


def test_idle_blocks_stay_cached_and_leave_least_recently_used_first():
    cache = PrefixCache(CFG, 6, 4, "cpu", torch.float32, stats=PrefixStats())
    for rid, first in ((0, 10), (1, 20)):
        req = Request(rid, list(range(first, first + 9)), 1)
        cache.take_prefix(rid, req.prompt)
        cache.reserve(rid, 9)
        req.computed = 9
        cache.note_computed(req)
    assert len(cache.key_of) == 4 and cache.free == []
    cache.release(0)
    assert list(cache.idle) == [1, 0] and cache.free == [2], "the partial block was kept or a full one freed"
    cache.release(1)
    assert list(cache.idle) == [1, 0, 4, 3], "a child must go idle before its parent, a request after another"
    assert cache.reserve(2, 16) and cache.stats.evictions == 2, "evicted more or fewer than the two blocks missing"
    assert list(cache.idle) == [4, 3] and 1 not in cache.key_of and 0 not in cache.key_of
    cache.check()
    assert cache.take_prefix(3, list(range(20, 29))) == 8, "a cached prefix was lost"
    assert cache.take_prefix(4, list(range(10, 19))) == 0, "an evicted prefix was found"


def test_a_held_block_is_never_evicted_and_a_cached_block_never_written():
    cache = PrefixCache(CFG, 4, 4, "cpu", torch.float32)
    req = Request(0, list(range(9)), 1)
    cache.take_prefix(0, req.prompt)
    cache.reserve(0, 9)
    req.computed = 8
    cache.note_computed(req)
    assert not cache.reserve(1, 8), "two blocks were granted from one free block: a held one was evicted"
    cache.check_writable(0, 8, 9)  # its own partial block
    with pytest.raises(RuntimeError, match="request 0 would write into block 1, which is cached"):
        cache.check_writable(0, 7, 9)
    with pytest.raises(RuntimeError, match="request 0 writes position 12, but its 3 blocks hold 12 tokens"):
        cache.check_writable(0, 8, 13)


def test_the_same_block_computed_twice_in_one_step_is_kept_once():
    cache = PrefixCache(CFG, 8, 4, "cpu", torch.float32)
    twins = [Request(rid, list(range(9)), 1) for rid in (0, 1)]  # admitted together: neither finds the other
    for req in twins:
        assert cache.take_prefix(req.rid, req.prompt) == 0 and cache.reserve(req.rid, 9)
        req.computed = 9
    assert cache.tables == {0: [0, 1, 2], 1: [3, 4, 5]}
    for req in twins:
        cache.note_computed(req)
    assert cache.tables[1] == [0, 1, 5], "the second copy of a cached block was kept"
    assert sorted(cache.free) == [3, 4, 6, 7] and cache.refs[:2] == [2, 2]
    cache.check()


def test_the_check_names_a_miscount():
    cache = PrefixCache(CFG, 4, 4, "cpu", torch.float32)
    cache.reserve(0, 8)
    cache.refs[1] = 2
    with pytest.raises(RuntimeError, match="block 1 counts 2 readers; 1 tables hold it"):
        cache.check()
    cache.refs[1] = 1
    cache.idle[1] = None
    with pytest.raises(RuntimeError, match="block 1 is in 2 of"):
        cache.check()


def test_a_plain_paged_cache_takes_no_prefix():
    cache = PagedKVCache(CFG, 4, 4, "cpu", torch.float32)
    assert cache.take_prefix(0, list(range(12))) == 0 and 0 not in cache.tables


# --- served with the cache, proved against decoding alone --------------------------------


def test_shared_prefixes_are_computed_once_and_every_request_equals_decoding_alone(model, documents):
    stream = shared_stream(documents)
    run, cache, logits = serve_one(model, stream, n_blocks=128)
    prompt = sum(len(r.prompt) for r in stream)
    computed = sum(s.prefill for s in run.steps)
    assert cache.stats.hit_tokens > 0 and computed == prompt - cache.stats.hit_tokens, "the cached tokens were computed"
    assert cache.stats.asked_tokens == prompt and cache.stats.evictions == 0
    assert cache.stats.hit_tokens <= reusable_tokens(run.requests, 4)
    worst, ties = check_against_alone(model, run.requests, FLOAT32, logits)
    assert worst < 1e-4 and ties == 0


def test_under_eviction_and_preemption_every_request_equals_decoding_alone(model, documents):
    stream = shared_stream(documents, 24)
    run, cache, logits = serve_one(model, stream, n_blocks=14)
    assert cache.stats.evictions > 0 and sum(r.preempted for r in run.requests) > 0, "no pressure"
    assert cache.stats.hit_tokens > 0
    check_against_alone(model, run.requests, FLOAT32, logits)


def test_conversations_find_the_last_turn_and_its_answer(model, documents):
    answer = functools.partial(greedy_answers, model)
    turns = conversation_stream(documents, np.random.default_rng(2), conversations=3, turns=3,
                                message_max=9, out_median=8, out_max=12, answer=answer)
    for before, after in zip(turns[:-3], turns[3:]):
        assert after.prompt[:len(before.prompt)] == before.prompt
    arrivals = [0.0] * 3 + [10.0] * 3 + [20.0] * 3  # each turn after the last one finished
    run, cache, logits = serve_one(model, turns, n_blocks=96, arrivals=arrivals)
    check_against_alone(model, run.requests, FLOAT32, logits)
    served = {r.rid: r for r in run.requests}
    for before, after in zip(turns[:-3], turns[3:]):
        history = before.prompt + served[before.rid].generated
        assert after.prompt[:len(history)] == history, "the next turn does not resend the answer served"
        assert cache.stats.first_hit[after.rid] >= (len(history) - 1) // 4 * 4, "a finished turn was not found"


def test_the_tree_links_each_block_to_the_one_before_it(model, documents):
    stream = shared_stream(documents, 6)
    cache = PrefixCache(CFG, 64, 4, "cpu", torch.float32)
    plan = functools.partial(plan_continuous, max_running=6, token_budget=64)
    trees = []
    take_turns(lambda: serve(model, fresh_requests(stream), cache, plan, retire_caching,
                             observe=lambda i, running, c: trees.append(cached_tree(c))))
    for nodes in trees:
        by_block, rows = {n.block: n for n in nodes}, tree_rows(nodes)
        for n in nodes:
            assert n.parent is None or by_block[n.parent].depth == n.depth - 1
        leaves = [rows[n.block] for n in nodes if not any(c.parent == n.block for c in nodes)]
        assert sorted(leaves) == list(range(len(leaves))), "two leaves share a row"
        assert {n.kind for n in nodes} <= {"cached", "copy", "own"}
    assert any(n.readers > 1 for nodes in trees for n in nodes), "no block was shared"


def test_the_same_tokens_after_another_prefix_are_not_reused(model):
    x, y = list(b"abcdefgh"), list(b"ijklmnop")
    requests = [Request(0, x + y + [1], 6), Request(1, y + x + [2], 6)]  # y at 8, then at 0
    run, cache, logits = serve_one(model, requests, n_blocks=32, arrivals=[0.0, 10.0])
    check_against_alone(model, run.requests, FLOAT32, logits)
    assert cache.stats.first_hit[1] == 0, "a block was found for tokens whose prefix differs"


def test_a_prompt_cached_whole_computes_its_last_token_in_a_block_of_its_own(model):
    prompt = list(b"shared prompt ab")  # four full blocks
    requests = [Request(0, prompt, 12), Request(1, prompt, 4)]  # the second while the first decodes
    run, cache, logits = serve_one(model, requests, n_blocks=32, arrivals=[0.0, 1e-9])
    assert cache.stats.first_hit[1] == 12, "the last block, which holds the token to compute, was taken"
    check_against_alone(model, run.requests, FLOAT32, logits)


# --- colliding hashes, and four planted faults, each caught ---------------------------------


def _blocks_after_other_prefixes():
    x, y = list(b"abcdefgh"), list(b"ijklmnop")
    return [Request(0, x + y + [1], 6), Request(1, y + x + [2], 6)]  # y at 8, then at 0


def _without_parent(parent, tokens):
    return hash(tuple(tokens))  # y's blocks collide with y's blocks at another place


def _one_key(parent, tokens):
    return 0  # every block collides with every other


@pytest.mark.parametrize("colliding", [_without_parent, _one_key])
def test_colliding_hashes_share_no_wrong_block(model, documents, colliding):
    run, cache, logits = serve_one(model, _blocks_after_other_prefixes(), n_blocks=32, arrivals=[0.0, 10.0],
                                   block_hash=colliding)
    check_against_alone(model, run.requests, FLOAT32, logits)
    assert cache.stats.first_hit[1] == 0, "a block was found for tokens whose prefix differs"
    stream = shared_stream(documents)
    run, cache, logits = serve_one(model, stream, n_blocks=14, block_hash=colliding)  # under eviction
    check_against_alone(model, run.requests, FLOAT32, logits)
    run, cache, logits = serve_one(model, stream, n_blocks=128, block_hash=colliding)  # each admitted once
    check_against_alone(model, run.requests, FLOAT32, logits)
    assert cache.stats.hit_tokens <= reusable_tokens(run.requests, 4), "found more than an exact cache finds"


class _IgnoresParent(PrefixCache):
    """The fault: a hit is checked against its tokens, not its parent block."""

    def find(self, key, tokens, parent):
        b = self.block_of.get(key)
        return b if b is not None and self.tokens_of[b] == tuple(tokens) else None


class _IgnoresTokens(PrefixCache):
    """The fault: a hit is taken on its key alone."""

    def find(self, key, tokens, parent):
        return self.block_of.get(key)


@pytest.mark.parametrize("fault, colliding", [(_IgnoresParent, _without_parent), (_IgnoresTokens, _one_key)])
def test_a_hit_not_checked_is_caught_when_hashes_collide(model, fault, colliding):
    run, _, logits = serve_one(model, _blocks_after_other_prefixes(), n_blocks=32, arrivals=[0.0, 10.0],
                               cache_type=fault, block_hash=colliding)
    with pytest.raises(AssertionError, match=r"request \d: logits differ from decoding it alone"):
        check_against_alone(model, run.requests, FLOAT32, logits)


class _IdleTooSoon(PrefixCache):
    """The fault: a cached block goes idle, evictable, as soon as one of its
    readers leaves, though others still read it."""

    def release(self, rid):
        for b in reversed(self.tables.pop(rid, [])):
            self.refs[b] -= 1
            if b in self.key_of:
                self.idle[b] = None
            elif self.refs[b] == 0:
                self.free.append(b)
        self.chains.pop(rid, None)


def test_a_block_evicted_while_a_request_reads_it_is_caught(model, documents, monkeypatch):
    stream = shared_stream(documents, 24)
    with pytest.raises(RuntimeError, match=r"block \d+ is in 2 of: the free list, the idle list, a table"):
        serve_one(model, stream, n_blocks=14, cache_type=_IdleTooSoon, check=True)  # at that step
    with pytest.raises(RuntimeError, match=r"would write into block \d+"):
        serve_one(model, stream, n_blocks=14, cache_type=_IdleTooSoon, check=False)  # handed out again
    monkeypatch.setattr(_IdleTooSoon, "check_writable", PagedKVCache.check_writable)  # without the write guard
    run, _, logits = serve_one(model, stream, n_blocks=14, cache_type=_IdleTooSoon, check=False)
    with pytest.raises(AssertionError, match="logits differ from decoding it alone"):
        check_against_alone(model, run.requests, FLOAT32, logits)  # a reader read another request's keys


class _RecomputesLastToken(PrefixCache):
    """The fault: a prompt found whole in the cache recomputes its last token
    (for the logits that choose the next one) in the shared block that holds it.
    It writes what is already there, so no output changes here; the write guard
    catches it (on a GPU, another request may be reading that row meanwhile)."""

    def take_prefix(self, rid, tokens):
        taken = super().take_prefix(rid, tokens + [None])  # every full block, the last one too
        return min(taken, len(tokens) - 1)


def test_a_request_writing_into_a_shared_block_is_caught(model):
    prompt = list(b"shared prompt ab")  # four full blocks
    requests = [Request(0, prompt, 12), Request(1, prompt, 4)]  # the second while the first decodes
    with pytest.raises(RuntimeError, match="request 1 would write into block 3, which is cached"):
        serve_one(model, requests, n_blocks=32, cache_type=_RecomputesLastToken, arrivals=[0.0, 1e-9])


# --- shared-prefix attention ---------------------------------------------------------------


def _shared_step(n_req, prefix, suffixes, dtype=torch.float32, block_size=4):
    """A cache in which ``n_req`` requests share ``prefix`` tokens, each with its own suffix
    (``suffixes``), one decode token each; random keys and values."""
    assert len(suffixes) == n_req
    return shared_prefix_step(CFG, prefix, suffixes, block_size, "cpu", dtype,
                              torch.Generator().manual_seed(n_req + prefix))


def test_the_shared_step_shares_the_prefix_blocks_and_feeds_each_last_token():
    cache, layout = _shared_step(3, 10, [1, 6, 3])
    tables = [cache.tables[i] for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2], "the two full blocks of the prefix are not shared"
    assert len({t[2] for t in tables}) == 3, "a partial block was shared"
    assert layout.kv_lengths.tolist() == [11, 16, 13] and layout.q_offsets.tolist() == [0, 1, 2, 3]
    assert cache.k.abs().sum() > 0 and cache.v.std() > 0.5, "the keys and values are not random"
    cache.check()


def _float64_reference(q, cache, layout, layer=0):
    """Attention of each request's one query over its whole rows, in float64, head by head."""
    rows = cache.block_size * layout.block_table.long()
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = CFG.n_heads // CFG.n_kv_heads
    for i, n in enumerate(layout.kv_lengths.tolist()):
        pos = torch.arange(n)
        idx = rows[i, pos // cache.block_size] + pos % cache.block_size
        k, v = (t[layer][idx].double().repeat_interleave(group, 1) for t in (cache.k, cache.v))  # (n, H, D)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) / q.shape[-1] ** 0.5
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("n_req, prefix, suffixes", [(1, 8, [3]), (3, 16, [1, 5, 9]), (8, 24, [4] * 8),
                                                     (5, 4, [13, 2, 7, 1, 20])])
def test_shared_prefix_attention_equals_attention_over_whole_rows(n_req, prefix, suffixes):
    cache, layout = _shared_step(n_req, prefix, suffixes)
    plan = plan_shared_prefix(cache, list(range(n_req)), layout.kv_lengths.tolist(), "cpu")
    assert len(plan.prefix_rows) == min(prefix, min(layout.kv_lengths.tolist()) - 1) // 4 * 4
    q = torch.randn(n_req, CFG.n_heads, CFG.head_dim, generator=torch.Generator().manual_seed(3))
    expected = _float64_reference(q, cache, layout)
    torch.testing.assert_close(shared_prefix_attention(q, cache, 0, plan).double(), expected, **FLOAT32)
    torch.testing.assert_close(gathered_attention(q, layout, 0).double(), expected, **FLOAT32)


def test_shared_prefix_attention_in_bfloat16_stays_within_its_tolerance():
    cache, layout = _shared_step(6, 16, [3] * 6, dtype=torch.bfloat16)
    plan = plan_shared_prefix(cache, list(range(6)), layout.kv_lengths.tolist(), "cpu")
    q = torch.randn(6, CFG.n_heads, CFG.head_dim).bfloat16()
    got = shared_prefix_attention(q, cache, 0, plan)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _float64_reference(q, cache, layout),
                               **tolerances(torch.bfloat16))


def test_merging_two_parts_by_lse_is_the_softmax_over_both():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 5, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    whole, lse = _attention_lse(q, k, v)
    torch.testing.assert_close(whole, torch.softmax(q @ k.mT / 8 ** 0.5, -1) @ v)
    torch.testing.assert_close(lse, (q @ k.mT / 8 ** 0.5).logsumexp(-1))
    first, second = _attention_lse(q, k[:, :2], v[:, :2]), _attention_lse(q, k[:, 2:], v[:, 2:])
    torch.testing.assert_close(_merge_by_lse(*first, *second), whole)
    mask = torch.tensor([True, True, False, False, True])
    masked, _ = _attention_lse(q, k, v, mask=mask)
    torch.testing.assert_close(masked, _attention_lse(q, k[:, mask], v[:, mask])[0])


def test_requests_that_share_no_block_are_refused_and_the_bound_counts_rows_read():
    cache, layout = _shared_step(2, 0, [6, 6])
    with pytest.raises(ValueError, match="share no block"):
        plan_shared_prefix(cache, [0, 1], layout.kv_lengths.tolist(), "cpu")
    assert rows_read(256, [32] * 16, shared=False) / rows_read(256, [32] * 16, shared=True) == 6.0


# --- the workloads and the repeated runs --------------------------------------------------


def test_system_prompts_stand_in_front_of_distinct_user_messages(documents):
    stream = system_prompt_stream(documents, 30, np.random.default_rng(4), systems=3, system_len=12,
                                  user_max=8, out_median=4, out_max=10)
    assert len({tuple(r.prompt[:12]) for r in stream}) == 3
    assert len({tuple(r.prompt[12:]) for r in stream}) == 30, "two requests share a user message"
    first = [Request(0, list(b"abcdefghij"), 1), Request(1, list(b"abcdefghXY"), 1), Request(2, list(b"abcdefgh"), 1)]
    assert reusable_tokens(first, 4) == 8 + 4, "the second finds two blocks, the third one (its last token computed)"
    with pytest.raises(ValueError, match="documents of at least 400 bytes"):
        system_prompt_stream(documents, 4, np.random.default_rng(4), systems=2, system_len=400, user_max=8,
                             out_median=4, out_max=10)


def test_with_and_without_the_cache_serve_the_same_requests_and_name_their_figures(model, documents):
    stream = shared_stream(documents, 8)
    plan = functools.partial(plan_continuous, max_running=4, token_budget=16)
    tree, logits = MostSharedTree(), TokenLogits()
    served = with_and_without(model, stream, plan, n_blocks=64, block_size=4, runs=2, observe=tree,
                              on_token=logits)
    for figure in (served.runs, served.prefill, served.per_token, served.ttft):
        assert set(figure) == {"with", "without"}
    assert all(len(done) >= 2 for done in served.runs.values())
    assert served.prefill["without"] == sum(len(r.prompt) for r in stream)
    assert served.prefill["with"] == served.prefill["without"] - served.stats.hit_tokens
    assert isinstance(served.cache, PrefixCache) and 0 < served.hit < 1 and served.bound > 1
    assert served.per_token["with"].runs == len(served.runs["with"])
    assert tree.sharing > 1 and tree.nodes and any(n.readers > 1 for n in tree.nodes), "no shared step kept"
    prove_every_run(model, [run for done in served.runs.values() for run in done], FLOAT32, logits)
    arriving = fresh_requests(stream, np.arange(8) * 1e-3)
    fig = draw_trace(arriving, with_and_without(model, arriving, plan, n_blocks=64, block_size=4, runs=1),
                     "a trace")
    assert len(fig.axes) == 2 and fig.axes[0].get_title() == "a trace"
    plt.close(fig)


def test_every_run_proved_and_the_cost_of_a_prompt_token(model, documents):
    stream = shared_stream(documents, 6)
    plan = functools.partial(plan_continuous, max_running=6, token_budget=16)
    logits = TokenLogits()

    def start():
        cache = PagedKVCache(CFG, 64, 4, "cpu", torch.float32)
        return serve(model, fresh_requests(stream), cache, plan, on_token=logits)

    runs, more = take_turns(start, start, runs=3)
    assert len(runs) >= 3 and len(more) >= 3
    assert prove_every_run(model, runs + more, FLOAT32, logits)[2] == 6 * (len(runs) + len(more))
    changed = runs[1].requests[0]

    class OneChanged(TokenLogits):  # the fault: one repeated request's logits differ
        def of(self, request):
            return logits.of(request) + (request is changed)

    with pytest.raises(AssertionError, match="request 0: logits differ from a proved request's"):
        prove_every_run(model, runs, FLOAT32, OneChanged())
    steps = [StepRecord(0.010, 0, 4, 4, 0, 0, 0)] * 3 + [StepRecord(0.012, 100, 4, 4, 0, 0, 0)] * 2
    assert prompt_token_seconds(steps) == pytest.approx(2e-5)
    assert skipping_bound(ServingRun([], steps), 100) == pytest.approx(0.054 / 0.052)
    with pytest.raises(ValueError, match="steps with prompt tokens and steps without"):
        prompt_token_seconds(steps[:3])
