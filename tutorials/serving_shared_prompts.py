"""
Serving shared prompts: prefix caching and shared-prefix attention
==================================================================

Real traffic repeats itself. A system prompt sits in front of every request;
each turn of a conversation sends the turns before it again. Cache the keys
of every full block of a prompt in the paged KV cache. Then a request that
begins as an earlier one did computes only the rest. Prove every request
unchanged. Measure it against the same server without the cache. And let
the requests of a decoding step that share a prefix read it once.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How a prefix cache keys each full block by its parent's key and its
         own tokens, counts the requests that read it, keeps it when they
         leave and evicts the least recently used when memory runs short
       * Why a shared block is never written, and how admission takes a
         newcomer's longest cached prefix
       * What skipping cached prompt tokens buys on this device, against
         what it could buy, with the spread of repeated runs
       * How shared-prefix (cascade) attention merges a prefix read once
         with each request's own keys by log-sum-exp, and where it pays

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`serving_continuous_batching` (the paged cache, block tables,
         continuous batching, the proof against decoding alone), from the
         site's package ``ragged_toolkit`` (:doc:`reference </toolkit>`)
       * PyTorch 2.11 or later; a CPU is enough
"""

# sphinx_gallery_tags = ["serving", "prefix caching", "paged attention", "cascade attention", "benchmarks"]

# %%
# Prompts that begin alike
# ------------------------
# A server's requests often begin alike: a system prompt, few-shot examples,
# a conversation's earlier turns sent again with each message. Attention is
# causal, so equal beginnings have equal keys and values in every layer.
# Automatic prefix caching in vLLM keys each full block of the paged cache
# by its parent's key and its own tokens. SGLang keeps a radix tree of
# cached prefixes. ``nano-vllm`` chains hashes with reference counts in
# about 120 lines. ``transformers``' continuous batching shares
# content-hashed blocks for full-attention models.
#
# The model, cache and scheduler are those of :doc:`serving_continuous_batching`,
# with the default token budget per step of vLLM (2,048). The prompts are
# longer and the answers shorter than there, as with a long system prompt
# and a short question. Real system prompts run to thousands of tokens.
# :term:`quick mode`, the test suite's fast run, shrinks the sizes.

from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(
        model=dict(
            vocab_size=256,
            dim=1024,
            n_layers=8,
            n_heads=16,
            n_kv_heads=4,
            ffn_hidden=2816,
            max_seq_len=4096,
        ),
        requests=128,
        systems=4,
        system_len=1024,
        user_max=128,
        out_median=32,
        out_max=128,
        slots=32,
        token_budget=2048,
        block=16,
        conversations=32,
        turns=4,
        message_max=128,
        runs=5,
        pressure=0.14,
        shared_cases=[
            (4, 1024, 1024),
            (4, 1024, 128),
            (16, 1024, 1024),
            (16, 1024, 128),
            (64, 2048, 256),
        ],
    ),
    "cpu": dict(
        model=dict(
            vocab_size=256,
            dim=128,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            ffn_hidden=352,
            max_seq_len=512,
        ),  # real models: billions of weights
        requests=64,
        systems=4,
        system_len=384,
        user_max=48,
        out_median=8,
        out_max=32,
        slots=16,
        token_budget=2048,
        block=16,
        conversations=16,
        turns=4,
        message_max=48,
        runs=5,
        pressure=0.14,
        shared_cases=[(4, 256, 256), (4, 256, 32), (16, 256, 256), (16, 256, 32), (32, 256, 32)],
    ),
    "quick": dict(
        model=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176),
        requests=24,
        conversations=8,
        turns=3,
        pressure=0.07,
        shared_cases=[(4, 128, 128), (16, 128, 16)],
    ),
}
setup = page_setup(SIZES)  # device, dtype, quick mode, one thread, seed; prints them
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
LOAD = 0.8  # online arrivals: this fraction of the rate the server without the cache served
print(
    f"{S.requests} requests, {S.slots} slots, {S.token_budget} tokens per step, "
    f"blocks of {S.block} rows"
)

# %%
# The model is the untrained GPT of :doc:`serving_continuous_batching`, in the
# page's dtype, with a float32 copy of its weights for the proof.

import torch
from ragged_toolkit.gpt import GPT, GPTConfig

cfg = GPTConfig(**S.model)
model = GPT(cfg).to(DEVICE).eval().to(DTYPE)
reference = GPT(cfg).to(DEVICE).eval()
reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, untrained")

# %%
# Two workloads that share
# ------------------------
# The prompts are openings of the site's corpus, the docstrings of Python's
# standard library (a token per byte). **System prompts**: ``systems`` long
# openings, each in front of many user messages. **Conversations**: turn
# ``n``'s prompt is turn ``n - 1``'s prompt, its answer and a new message. The
# answer is what greedy decoding of that turn alone gives, as a client would
# send it back. The proof below shows that the server generates exactly it.
# Both stream all requests at time 0 (offline) or at a stated rate (online).
# ``reusable_tokens`` counts the prompt tokens, in full blocks, that an earlier
# request's blocks hold: what a cache that never evicts could find.

import numpy as np
from ragged_site.corpus import docstring_corpus
from ragged_site.serving.shared_prompts import (
    conversation_stream,
    greedy_answers,
    reusable_tokens,
    stream_summary,
    system_prompt_stream,
)

docs, source = docstring_corpus(min_chars=2)
rng = np.random.default_rng(setup.seed)
systems = system_prompt_stream(
    docs,
    S.requests,
    rng,
    systems=S.systems,
    system_len=S.system_len,
    user_max=S.user_max,
    out_median=S.out_median,
    out_max=S.out_max,
)
chats = conversation_stream(
    docs,
    rng,
    conversations=S.conversations,
    turns=S.turns,
    message_max=S.message_max,
    out_median=2 * S.out_median,
    out_max=S.out_max,
    answer=lambda p, n: greedy_answers(model, p, n, DTYPE),
)
print(f"prompts and messages: the openings of {source}")
for name, stream in (("system prompts", systems), ("conversations", chats)):
    print(f"{name}: {stream_summary(stream)}")

# %%
# The prefix cache
# ----------------
# A full block is found by its *key*. The key is one number, hashed from
# the parent block's key and the block's own tokens. The parent's key was
# hashed from the grandparent's, and so on. So the key stands for every token
# from position 0 to the block's end, yet hashing a block reads only its own
# tokens. Leave the parent out, and the same tokens elsewhere would read keys
# computed for another context and position:
#
# .. literalinclude:: ../ragged_toolkit/serving/prefix_cache.py
#    :pyobject: block_hash
#
# Two different prefixes can hash to one number. So a hit is checked: the
# block found must hold the same tokens after the same parent block. A
# collision then costs a miss, never a wrong block:
#
# .. literalinclude:: ../ragged_toolkit/serving/prefix_cache.py
#    :pyobject: PrefixCache.find
#
# ``PrefixCache`` is the paged cache of :doc:`serving_continuous_batching`
# with three more things per block. It keeps the block's key, once the block
# is full and computed. ``refs`` counts the requests whose table holds it. A
# block is *idle* when it is cached but read by none. Admission takes a
# newcomer's longest cached prefix of full blocks. It leaves at least the
# last token to compute, since its logits choose the next:
#
# .. literalinclude:: ../ragged_toolkit/serving/prefix_cache.py
#    :pyobject: PrefixCache.take_prefix
#
# A request's new blocks come from the free list. When it runs short, idle
# blocks are evicted, least recently used first. A block that a request
# holds is never idle. So eviction never takes what a running request reads.
# Preemption only releases the preempted request's hold:
#
# .. literalinclude:: ../ragged_toolkit/serving/prefix_cache.py
#    :pyobject: PrefixCache.reserve
#
# .. literalinclude:: ../ragged_toolkit/serving/prefix_cache.py
#    :pyobject: PrefixCache.release
#
# After each step, the blocks that the step filled get their keys, so a
# request admitted at the next step finds them. If two requests computed the
# same block in one step, the second reads the first one's block and frees
# its own copy:
#
# .. literalinclude:: ../ragged_toolkit/serving/prefix_cache.py
#    :pyobject: PrefixCache.note_computed
#
# A last, partial block is never shared. Its request writes its next tokens
# into its free rows. Sharing it would need copy-on-write, as vLLM once did
# for beam search. Keying only full, computed blocks makes every shared
# block read-only by construction. The cost is recomputing fewer than
# ``block`` tokens per request. The cache refuses any write into a cached or
# shared block (``check_writable``). How often admissions found their prefix
# is counted outside the cache, by a ``PrefixStats`` it reports to. Two
# requests, a cache of six blocks of four rows:

from ragged_toolkit.serving.prefix_cache import PrefixCache, PrefixStats
from ragged_toolkit.serving.requests import Request

tiny = GPTConfig(
    vocab_size=64, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=16, max_seq_len=32
)
demo_stats = PrefixStats()
demo = PrefixCache(
    tiny, n_blocks=6, block_size=4, device="cpu", dtype=torch.float32, stats=demo_stats
)
first = Request(0, [5, 1, 2, 3, 4, 6, 7, 8, 9, 10], 1)
second = Request(1, [5, 1, 2, 3, 4, 6, 7, 8, 42], 1)
for req in (first, second):
    req.computed = demo.take_prefix(req.rid, req.prompt)  # the second finds two blocks
    assert demo.reserve(req.rid, len(req.prompt))
    print(
        f"request {req.rid}: {req.computed} of {len(req.prompt)} tokens cached, table "
        f"{demo.tables[req.rid]}"
    )
    req.computed = len(req.prompt)  # what its prefill computes
    demo.note_computed(req)
print(f"readers of blocks 0-3: {demo.refs[:4]}; keyed: {sorted(demo.key_of)}")
demo.release(0), demo.release(1)
print(f"both left: idle (cached) {list(demo.idle)}, free {sorted(demo.free)}")
assert demo.reserve(2, 20) and demo_stats.evictions == 1  # five blocks: one idle block evicted
demo.check()  # every block free, idle or held, its readers counted right
print(
    f"a request of 20 tokens took {demo.tables[2]}, evicting {demo_stats.evictions} idle block; "
    f"still cached: {list(demo.idle)}"
)


# %%
# Admission takes the cached prefix
# ---------------------------------
# The continuous-batching scheduler of :doc:`serving_continuous_batching` asks
# the cache for a newcomer's cached prefix (``take_prefix``). It asks before it
# reserves the rest; a plain paged cache has no prefix to give. So the prompt
# chunk it schedules starts after the cached tokens. The server's step end keys
# the blocks the step filled, then lets finished requests leave.
#
# .. literalinclude:: ../ragged_toolkit/serving/schedulers.py
#    :pyobject: plan_continuous
#
# .. literalinclude:: ../ragged_toolkit/serving/prefix_cache.py
#    :pyobject: retire_caching

import functools

from ragged_toolkit.serving.schedulers import plan_continuous

continuous = functools.partial(plan_continuous, max_running=S.slots, token_budget=S.token_budget)
longest = max(len(r.prompt) + r.n_out for r in systems + chats)
# room for every running request, and a cache beside it
ample = S.slots * -(-longest // S.block) * 2

# %%
# With and without the cache, all requests waiting
# ------------------------------------------------
# ``with_and_without`` serves the system-prompt requests offline twice: with
# a ``PrefixCache``, and with a plain ``PagedKVCache``. The two take turns
# step by step, each at least ``runs`` times. As on
# :doc:`serving_continuous_batching`, throughput is the median over the runs,
# with its interquartile range (IQR). A speedup is claimed only where the two
# ranges do not overlap. The time to first token is the median of the runs'
# p50s. Here the :term:`work bound` is what skipping the cached prompt tokens
# could buy at this device's costs. Take the busy time of a run without the
# cache. The bound divides it by that time less what the skipped prompt
# tokens cost. A prompt token's cost is read from that run's own steps. The
# :term:`fraction of the bound` is the measured speedup over the bound:
#
# .. literalinclude:: ../ragged_site/serving/runs.py
#    :pyobject: prompt_token_seconds

from ragged_site.measuring.noise import MIN_RUNS, outside_noise
from ragged_site.serving.prefix_tree import MostSharedTree
from ragged_site.serving.proof import TokenLogits
from ragged_site.serving.metrics import rate_spread, speedup_claim
from ragged_site.serving.runs import prefix_cache_line, prompt_token_seconds, with_and_without
from ragged_site.records import record

assert S.runs >= MIN_RUNS, "the noise rule needs MIN_RUNS runs of each server"
served_logits = TokenLogits()  # every run's logits, for the proof at the end (a server keeps none)
both = dict(plan=continuous, n_blocks=ample, block_size=S.block, runs=S.runs)
serve_both = functools.partial(with_and_without, model, on_token=served_logits, **both)
tree = MostSharedTree()  # the cached blocks at the step where most requests share them, drawn below
offline = serve_both(systems, observe=tree)
per_token, W = offline.per_token, offline.bound
K, N = offline.prefill["with"], offline.prefill["without"]
line, figures = prefix_cache_line(offline)  # hit rate, time to first token, throughput, bound
print(record("serving", line, label="prefix cache", **figures))
for name, t in per_token.items():
    print(f"{name} the cache: {rate_spread(t)}")
apart = outside_noise(per_token["with"], per_token["without"])
print("the speedup " + speedup_claim(apart))

# %%
# Counting tokens alone, the cache computes ``K`` prompt tokens and the same
# decode tokens instead of ``N`` and them. That ratio misleads where a step
# costs much more than the prompt tokens it carries. The work bound weighs
# each token by what it costs in the run without the cache:

decode_tokens = sum(r.n_out for r in systems)
without = offline.runs["without"][0]
step_ms = np.median([s.seconds for s in without.steps if s.prefill == 0]) * 1e3
prompt_ms = prompt_token_seconds(without.steps) * 1e3
ratio = (N + decode_tokens) / (K + decode_tokens)
line = f"token-count ratio {ratio:.2f}x, work bound {W:.2f}x"
print(record("bound", line, label="prefix cache", token_count_ratio=ratio, bound=W))
print(
    f"a decode-only step costs {step_ms:.2f} ms, a prompt token adds {prompt_ms:.3f} ms "
    f"({step_ms / prompt_ms:.0f} of them cost a step)"
)
if ratio > W:
    verdict = "overstates the time saved: decode steps, not shortened, cost more than their tokens"
else:
    verdict = "understates the time saved: prompt tokens cost more than their count"
print(f"the token count {verdict}")

# %%
# Arriving over time
# ------------------
# Online, the same requests arrive one by one, Poisson-distributed, at
# ``LOAD`` times the rate the server without the cache served offline. The
# time to first token is what a user waits: queuing and prefill. Over the
# trace (each server's first run), each request's share of its prompt found
# cached, and its time to first token:

import matplotlib.pyplot as plt
from ragged_site.figures import FIGURE_STYLE
from ragged_site.workloads import fresh_requests, poisson_arrivals
from ragged_site.serving.runs import busy_seconds, draw_trace

# requests/s
rate = LOAD * S.requests / np.median([busy_seconds(run) for run in offline.runs["without"]])
arriving = fresh_requests(
    systems, poisson_arrivals(np.random.default_rng(setup.seed + 1), S.requests, rate)
)
online = serve_both(arriving)
late = {k: t.median_ms for k, t in online.ttft.items()}
print(
    f"online, {rate:.1f} requests/s, hit rate {online.hit:.0%}: time to first token p50 "
    f"{late['with']:.0f} ms with the cache, {late['without']:.0f} ms without"
)
print(f"  (the median of {len(online.runs['with'])} and {len(online.runs['without'])} runs)")

plt.rcParams.update(FIGURE_STYLE)
title = f"System prompts arriving at {rate:.1f} requests/s (without the cache: no hit)"
draw_trace(arriving, online, title)
plt.show()

# %%
# Conversations
# -------------
# In a conversation the shared prefix grows. Each turn sends again the last
# turn's prompt and answer. The last turn left their blocks cached: a block
# filled while decoding is keyed too. All turns wait at once, every first
# turn before every second. A turn that starts before the last ends finds less:

chat = serve_both(chats)
can = reusable_tokens(chat.runs["with"][0].requests, S.block)
R2, P2 = (1e3 / chat.per_token[k].median_ms for k in ("with", "without"))
same = not outside_noise(chat.per_token["with"], chat.per_token["without"])
print(
    f"conversations: hit rate {chat.hit:.0%} (a cache that never evicts, each turn after "
    f"the last: {can / sum(len(r.prompt) for r in chats):.0%}),"
)
print(f"  prefill tokens {chat.prefill['with']} of {chat.prefill['without']} computed")
line = (
    f"  throughput {R2:.0f} tokens/s (without: {P2:.0f}), speedup {R2 / P2:.2f}x, "
    f"work bound {chat.bound:.2f}x" + (" (within the noise)" if same else "")
)
figures = dict(tokens_per_s={"with": R2, "without": P2}, speedup=R2 / P2, bound=chat.bound)
print(
    record("serving", line, label="conversations", **figures, hit_rate=chat.hit, within_noise=same)
)

# %%
# Which requests share which blocks
# ---------------------------------
# The cached blocks form a tree: a block's parent is the block before it in
# the prefixes that hold it. At the offline step where most requests read a
# shared block, each system prompt is a trunk that branches into user
# messages. Requests admitted in one step all compute their prompts. The
# first to finish a block keys it; the others keep copies (drawn hollow, if any).
#
# .. literalinclude:: ../ragged_site/serving/prefix_tree.py
#    :pyobject: cached_tree

from ragged_site.serving.prefix_tree import draw_most_shared

draw_most_shared(tree, S.block)
plt.show()

# sphinx_gallery_thumbnail_number = 2

# %%
# Under pressure: eviction and preemption
# ---------------------------------------
# The system prompts run again, all waiting, in a cache of ``pressure`` times
# the blocks the runs above had. It is too small to keep every prefix, so idle
# blocks are evicted. The user messages' blocks go first, since the system
# prompts' are read again and again. It is also too small for every running
# request, so the scheduler preempts. A preempted request's full blocks stay
# cached, idle, so that it recomputes only what was evicted meanwhile.
# ``check`` verifies after each step that every block is free, idle or held,
# its readers counted.

from ragged_toolkit.serving.prefix_cache import retire_caching
from ragged_toolkit.serving.server import serve, take_turns

pressure_stats = PrefixStats()
pressure = PrefixCache(cfg, int(S.pressure * ample), S.block, DEVICE, DTYPE, stats=pressure_stats)
under_pressure = (model, fresh_requests(systems), pressure, continuous, retire_caching)
[[pressed]] = take_turns(lambda: serve(*under_pressure, check=True, on_token=served_logits))
preempted = sum(r.preempted for r in pressed.requests)
evictions = pressure_stats.evictions
assert preempted > 0 and evictions > 0, "the cache was never short: nothing tested eviction"
print(
    f"{pressure.n_blocks} blocks: {evictions} evictions, {preempted} preemptions, hit rate "
    f"{pressure_stats.hit_rate():.0%}"
)

# %%
# Proof: every request equals decoding it alone
# ---------------------------------------------
# Every request of every run above is checked as on
# :doc:`serving_continuous_batching`: against decoding it alone in float32,
# without a cache. A request may generate the same tokens for the same
# prompt as one already proved. It is checked against that one's logits.
#
# .. literalinclude:: ../ragged_site/serving/runs.py
#    :pyobject: prove_every_run

from ragged_site.page import tolerances
from ragged_site.serving.runs import prove_every_run

PROOF_TOLERANCE = tolerances(DTYPE) if DTYPE == torch.float32 else dict(atol=0.1, rtol=0.05)
every = [
    run for result in (offline, online, chat) for runs in result.runs.values() for run in runs
] + [pressed]
worst, ties, checked = prove_every_run(reference, every, PROOF_TOLERANCE, served_logits)
criterion = ", ".join(f"{k} {v:g}" for k, v in PROOF_TOLERANCE.items())
print(
    f"every request of every run, {str(DTYPE).removeprefix('torch.')}: equal to decoding it "
    f"alone ({criterion})"
)
print(
    f"{len(every)} runs (a faster server ran more often), {checked} requests: "
    f"largest difference {worst:.1e}, {ties} ties within atol"
)

# %%
# The tests (``tests/test_prefix_cache.py``) also serve with hashes that
# collide on purpose: every request still equals decoding it alone. They
# plant four faults and catch each. Two skip a check on a hit: against its
# parent, or against its tokens. One evicts a block while a request still
# reads it. One writes into a shared block.
#
# Shared-prefix attention
# -----------------------
# The cache stores a shared prefix once, but a decoding step still reads it
# once per request. The gathered path of :doc:`serving_continuous_batching`
# copies each request's whole rows and attends over them (one call per
# request on a CPU). *Shared-prefix* (cascade) attention reads the prefix
# once. All the queries that share it meet its keys in one call. Each
# request then meets its own suffix. The two parts are merged exactly. A
# softmax over two parts is each part's softmax, weighted by its share of the
# whole denominator. Each part's log-sum-exp gives that share:
#
# .. literalinclude:: ../ragged_toolkit/serving/shared_prefix_attention.py
#    :pyobject: _attention_lse
#
# .. literalinclude:: ../ragged_toolkit/serving/shared_prefix_attention.py
#    :pyobject: _merge_by_lse
#
# .. literalinclude:: ../ragged_toolkit/serving/shared_prefix_attention.py
#    :pyobject: shared_prefix_attention
#
# In each case below, ``Q`` requests sharing ``L`` cached tokens, each with
# ``S`` of its own, decode one token (``shared_prefix_step``: random keys).
# Shared-prefix attention must give the gathered path's output (the tests
# check both against float64), then both are timed. The work bound counts
# the rows of keys and values read: the gathered path reads the prefix ``Q``
# times.

from ragged_toolkit.serving.paged_attention import gathered_attention
from ragged_toolkit.serving.shared_prefix_attention import (
    plan_shared_prefix,
    shared_prefix_attention,
)
from ragged_site.serving.shared_prompts import rows_read, shared_prefix_step, time_shared_prefix

cases = {}
for n_req, prefix, suffix in S.shared_cases:
    shared, layout = shared_prefix_step(cfg, prefix, [suffix] * n_req, S.block, DEVICE, DTYPE)
    plan = plan_shared_prefix(shared, list(range(n_req)), layout.kv_lengths.tolist(), DEVICE)
    q = torch.randn(n_req, cfg.n_heads, cfg.head_dim, device=DEVICE, dtype=DTYPE)
    paths = {
        "gathered": functools.partial(gathered_attention, q, layout, 0),
        "shared": functools.partial(shared_prefix_attention, q, shared, 0, plan),
    }
    torch.testing.assert_close(paths["shared"](), paths["gathered"](), **tolerances(DTYPE))
    reads = {s: rows_read(len(plan.prefix_rows), plan.suffix_used.sum(1), s) for s in (False, True)}
    cases[n_req, prefix, suffix] = dict(bound=reads[False] / reads[True], paths=paths)

timed = time_shared_prefix(cases)  # each case's two paths take turns; a line each

# %%
# Shared-prefix attention may not pay with few requests, or with suffixes as
# long as the prefix. There the work bound is small, since little is read
# only once. The second call and the merge may then cost more than the rows
# they save. The lines below sort the cases measured here. The chart draws
# each speedup beside its work bound:

from ragged_site.serving.shared_prompts import draw_shared_prefix, print_where_it_pays

print_where_it_pays(timed)
draw_shared_prefix(timed, cases)
plt.show()

# %%
# Conclusion
# ----------
# A prefix cache is bookkeeping on top of the paged cache. It adds a key per
# full block that names everything before it, and a count of readers. It
# adds an idle list that keeps blocks until their memory is needed. The
# proof says that no request changed. Shared-prefix attention carries the
# sharing into each decoding step's reads.
#
# References
# ----------
# * vLLM, automatic prefix caching: https://docs.vllm.ai/en/latest/design/prefix_caching.html
# * Zheng et al., "SGLang: Efficient Execution of Structured Language Model
#   Programs" (RadixAttention), 2024: https://arxiv.org/abs/2312.07104
# * ``nano-vllm``'s block manager: https://github.com/GeeeekExplorer/nano-vllm
# * FlashInfer, cascade attention: https://flashinfer.ai/2024/02/02/cascade-inference.html
# * attention-gym, shared-prefix split attention: https://github.com/meta-pytorch/attention-gym
