"""
Serving ragged requests: continuous batching with a paged KV cache
==================================================================

Serve a stream of requests of different lengths the way inference servers
do. A scheduler lets finished requests leave and waiting ones join at every
step. Prompts are packed with the decode tokens of the others. The KV cache
comes in fixed-size blocks. The server is proved against decoding each
request alone, and measured against static batches.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How a paged KV cache works: blocks, a free list, block tables, and
         attention reading each request's keys through them
       * How a step packs prompt chunks with decode tokens, and how a
         continuous-batching scheduler plans it (token budget, admissions,
         preemption) and refuses a bad request by name
       * How to prove a server correct (every request equals decoding it
         alone) and measure it: throughput over repeated runs with its
         spread, beside the slot bound; latency; requests per MiB of cache

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`ragged_decoding_kv_cache_gqa` (a KV cache for a ragged batch)
         and the GPT of :doc:`packed_gpt_training`, from the site's package
         ``ragged_toolkit`` (:doc:`reference </toolkit>`)
       * PyTorch 2.11 or later; a CPU is enough, and a CUDA GPU adds
         ``varlen_attn`` reading the paged cache where the release can
"""

# sphinx_gallery_tags = ["serving", "continuous batching", "paged attention", "benchmarks"]

# %%
# The most ragged batch
# ---------------------
# :doc:`ragged_decoding_kv_cache_gqa` runs one static batch. Servers (vLLM,
# SGLang, TGI, ``transformers``' continuous batching) let finished requests
# leave and waiting ones join at every step. They pack newcomers' prompts
# with each running request's decode token. They also *page* the cache, so
# that memory follows the tokens in use. Every step is a new ragged batch.
#
# Sizes are set per device. :term:`quick mode`, the test suite's fast run,
# shrinks them. The CPU's sizes build the page in well under a minute on two
# cores. Servers run billions of weights, hundreds of requests and prompts
# of thousands of tokens; vLLM uses blocks of 16 rows. CUDA blocks have 256
# rows, the fewest the paged kernel of FlashAttention takes. ``runs``: how
# often each scheduler serves the stream.

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
            max_seq_len=2048,
        ),
        requests=64,
        slots=32,
        token_budget=512,
        block=256,
        prompt_max=512,
        out_median=96,
        out_max=512,
        contiguous_slots=16,
        runs=5,
        run_time=1.0,
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
        ),
        requests=48,
        slots=16,
        token_budget=64,
        block=16,
        prompt_max=48,
        out_median=32,
        out_max=192,
        contiguous_slots=8,
        runs=5,
        run_time=0.3,
    ),
    "quick": dict(
        model=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176),
        requests=12,
        slots=8,
        out_median=16,
        out_max=48,
        contiguous_slots=4,
        run_time=0.1,
    ),
}
setup = page_setup(SIZES)
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
LOAD = 0.7  # online arrivals: this fraction of what continuous batching served offline
print("model: " + ", ".join(f"{k} {v}" for k, v in S.model.items()))
print(
    f"{S.requests} requests, {S.slots} slots, {S.token_budget} tokens per step, blocks of {S.block} rows"
)

# %%
# A paged KV cache
# ----------------
# A paged cache cuts its rows into blocks of ``block_size``. A request holds
# a *block table*: the list of its blocks. They come from a free list, and go
# back to it when the request leaves. Its token at position ``p`` lives in row
# ``table[p // block_size] * block_size + p % block_size``:
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: PagedKVCache
#
# Attention reads the rows of every key a step uses through ``paged_rows``:
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: paged_rows
#
# Three requests in blocks of 4; the second leaves, and a fourth comes:

import torch
from ragged_toolkit.gpt import GPTConfig
from ragged_toolkit.kv_cache import block_table_tensor, paged_rows, PagedKVCache

tiny_cfg = GPTConfig(
    vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=16, max_seq_len=32
)
demo = PagedKVCache(tiny_cfg, n_blocks=8, block_size=4, device="cpu", dtype=torch.float32)
assert all(demo.reserve(rid, n) for rid, n in ((0, 6), (1, 3), (2, 9)))
print(f"block tables {demo.tables}, free list {demo.free}")
demo.release(1)
assert demo.reserve(3, 4) and demo.tables[3] == [2]
demo.check()  # every block is free or in exactly one table
print(f"request 1 left, request 3 came: tables {demo.tables}, free list {demo.free}")
table = block_table_tensor(demo, [0, 2], "cpu")  # (B, max_blocks), what attention reads
rows = paged_rows(table, torch.tensor([6, 9]), demo.block_size)
assert rows.tolist() == [0, 1, 2, 3, 4, 5] + [12, 13, 14, 15, 16, 17, 18, 19, 20]
print(f"block table of requests 0 and 2: {table.tolist()}\nthe rows of their keys: {rows.tolist()}")

# %%
# A stream of requests
# --------------------
# Prompts are openings of docstrings from Python's standard library, one token
# per byte. Output lengths are long-tailed and fixed, as benchmarks ignore the
# end-of-sequence token. So every scheduler does the same work. The model is
# the GPT of :doc:`packed_gpt_training`, untrained: a server's correctness and
# speed do not depend on its weights. A float32 copy of its weights is the
# proof's reference.

import numpy as np
from ragged_site.corpus import docstring_corpus
from ragged_site.workloads import request_stream

docs, source = docstring_corpus(min_chars=2)
stream = request_stream(
    docs,
    S.requests,
    np.random.default_rng(setup.seed),
    prompt_max=S.prompt_max,
    out_median=S.out_median,
    out_max=S.out_max,
)
prompt_lengths = np.array([len(req.prompt) for req in stream])
out_lengths = np.array([req.n_out for req in stream])
print(
    f"prompts: openings of {source}, {prompt_lengths.min()} to {prompt_lengths.max()} "
    f"tokens, mean {prompt_lengths.mean():.1f}"
)
print(
    f"outputs: log-normal, median {S.out_median}, sigma 1, cut to {S.out_max}: "
    f"{out_lengths.min()} to {out_lengths.max()} tokens, mean {out_lengths.mean():.1f}"
)

from ragged_toolkit.gpt import GPT

cfg = GPTConfig(**S.model)
model = GPT(cfg).to(DEVICE, DTYPE).eval()  # a server runs its weights in the low precision too
reference = GPT(cfg).to(DEVICE).eval()
reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
print(f"{sum(w.numel() for w in model.parameters()) / 1e6:.2f} M parameters, untrained")

# %%
# One step: prompt chunks and decode tokens together
# --------------------------------------------------
# A step runs the GPT once on a packed batch of new tokens. A decoding
# request brings its last generated token; a newcomer brings a chunk of its
# prompt. Each comes after the ``computed`` tokens of its history (``prompt +
# generated``), already cached. ``build_step`` packs the tokens and their
# positions, which restart per request. It packs each new key's cache row
# (its *slot*), and each request's keys in use and block table. It adds what
# attention reads the cache with. All of it is built once for every layer.
#
# .. literalinclude:: ../ragged_toolkit/serving/engine.py
#    :pyobject: build_step
#
# A step as the server builds it, ``slots - 1`` requests decoding and a
# newcomer's prompt chunk:

from ragged_toolkit.serving.engine import build_step, forward_step
from ragged_site.workloads import fresh_requests

blocks_per_slot = -(-(S.prompt_max + S.out_max) // S.block)  # a full-length request's blocks
bench_cache = PagedKVCache(cfg, S.slots * blocks_per_slot, S.block, DEVICE, DTYPE)
*decoding, newcomer = bench = fresh_requests(stream[: S.slots])
assert all(bench_cache.reserve(req.rid, len(req.prompt) + 1) for req in bench)
forward_step(model, bench_cache, [(req, req.pending()) for req in decoding])  # their prefill
chunk = min(len(newcomer.prompt), S.token_budget - len(decoding))
step_work = [(req, 1) for req in decoding] + [(newcomer, chunk)]
tokens, positions, layout = build_step(bench_cache, step_work, DEVICE)
# packed in the work's order
assert layout.q_offsets.diff().tolist() == [1] * len(decoding) + [chunk]
print(
    f"one step, {len(tokens)} tokens: {len(decoding)} decode tokens, then a prompt chunk of {chunk} at positions "
    f"{int(positions[-chunk])} to {int(positions[-1])};\nkeys in use per request {int(layout.kv_lengths.min())} "
    f"to {int(layout.kv_lengths.max())}, block table {tuple(layout.block_table.shape)}"
)

# %%
# Attention through the block table
# ---------------------------------
# ``PagedLayout``, the step's :term:`layout`, writes each new key into its
# slot. A query sees its request's keys up to its position (causal,
# bottom-right). It reads them one of three ways. **gathered**: the rows
# ``paged_rows`` names, in a packed batch for ``ragged_attention``.
# **flex**: FlexAttention over the whole cache in place, its block mask
# letting a query see its request's rows. **varlen**: ``varlen_attn``
# reading the cache in place through ``block_table`` (the paged kernel of
# FlashAttention, CUDA only).
#
# .. literalinclude:: ../ragged_toolkit/serving/paged_attention.py
#    :pyobject: gathered_attention
#
# .. literalinclude:: ../ragged_toolkit/serving/paged_attention.py
#    :pyobject: _paged_block_mask
#
# .. literalinclude:: ../ragged_toolkit/serving/paged_attention.py
#    :pyobject: _varlen_paged_attention
#
# Each path runs the model on the step above (``step_logits``).
# ``time_and_prove_paths`` times each, the first call (compiling) apart.
# Each time shows its :term:`kernel label`: the attention kernel that ran.
# Each must give every request the logits of decoding it alone
# (``logits_after``). ``choose`` takes the fastest only outside the noise,
# else the gathered path.

import functools

from ragged_site.page import tolerances
from ragged_site.measuring.noise import choose
from ragged_toolkit.attention.flex import FlexKernel
from ragged_toolkit.serving.engine import step_logits
from ragged_toolkit.serving.paged_attention import paged_varlen_support
from ragged_site.serving.batching import time_and_prove_paths

PROOF_TOLERANCE = tolerances(DTYPE) if DTYPE == torch.float32 else dict(atol=0.1, rtol=0.05)
FLEX = FlexKernel()  # the server's compiled FlexAttention, built once, passed to every step
PATHS = {"gathered": None, "flex": None, "varlen": paged_varlen_support(DEVICE, DTYPE, S.block)}
logits_of = functools.partial(step_logits, model, bench_cache, step_work, flex=FLEX)  # (path)
timed = dict(run_time=S.run_time, profile=not setup.quick)  # profiled outside quick mode
timings = time_and_prove_paths(logits_of, PATHS, reference, step_work, PROOF_TOLERANCE, **timed)
PATH = choose(timings, "gathered", f"paged attention on {DEVICE}")

# %%
# The scheduler
# -------------
# One engine serves every scheduler. ``forward_step`` gives its greedy next
# token to each request whose history is then all in the cache. So prefill,
# chunked prefill, decoding and recomputation are one operation.
#
# .. literalinclude:: ../ragged_toolkit/serving/engine.py
#    :pyobject: forward_step
#
# Continuous batching plans each step anew. Running requests come first.
# Newcomers follow while blocks, slots and the token budget allow, a long
# prompt cut into chunks. A running request may need a block when none is
# free. Then the most recently admitted request is *preempted*, as vLLM does.
# Its blocks are freed, and it waits at the front of the queue to recompute
# its keys.
#
# .. literalinclude:: ../ragged_toolkit/serving/schedulers.py
#    :pyobject: plan_continuous
#
# The baseline, ``plan_static``, batches as a batched ``generate`` does. Its
# prefill is packed too, so that only the scheduling differs. ``slots``
# requests start together and decode until the longest is done. A finished
# request's slot computes a padding token. ``serve`` runs a scheduler on a
# clock. Each step's measured time advances the clock; when idle, it jumps
# to the next arrival. ``serve`` runs one step a turn, so that runs take
# turns (``take_turns``) until each has ended ``runs`` times. Whatever else
# the machine does then weighs on all alike.

from ragged_toolkit.serving.schedulers import plan_continuous, plan_static, retire_batch
from ragged_toolkit.serving.server import serve, take_turns

serving_blocks = S.slots * blocks_per_slot  # the same cache for all: ``slots`` full-length requests
SCHEDULERS = {
    "continuous": functools.partial(
        plan_continuous, max_running=S.slots, token_budget=S.token_budget
    ),
    "static": functools.partial(plan_static, batch_size=S.slots, reserve=S.out_max),
    "static, skipping": functools.partial(
        plan_static, batch_size=S.slots, reserve=S.out_max, skip_finished=True
    ),
}


# A request keeps its tokens, not the logits that chose them. The proof at the
# end of the page needs those logits, so every run hands them to one record
# through ``serve``'s ``on_token``.
from ragged_site.serving.proof import TokenLogits

served_logits = TokenLogits()  # what the proof reads; a server in production leaves on_token out


def starter(plan, requests, n_blocks=serving_blocks, **kw):
    """Starts a run of ``serve``: fresh requests, a cache of their own; a static plan retires whole batches."""
    if plan.func is plan_static:
        kw["retire_step"] = retire_batch
    return lambda: serve(
        model,
        fresh_requests(requests),
        PagedKVCache(cfg, n_blocks, S.block, DEVICE, DTYPE),
        plan,
        path=PATH,
        flex=FLEX,
        on_token=served_logits,
        **kw,
    )


# %%
# Requests the server cannot serve
# --------------------------------
# ``check_request`` refuses a bad request by name, with the limit it breaks.
# It refuses an empty prompt, an output length below one and a token outside
# the vocabulary. It also refuses more positions than the model has, or more
# tokens than the whole cache holds:
#
# .. literalinclude:: ../ragged_toolkit/serving/requests.py
#    :pyobject: check_request
#
# ``serve`` checks a batch given up front before its first step. With
# ``on_refused``, it checks each request on arrival, while the others run on:

from ragged_toolkit.serving.requests import Request

small = blocks_per_slot  # a cache for one full-length request, with preemption for more
bad = [
    Request(900, [], 8),
    Request(901, [65] * 8, cfg.max_seq_len),
    Request(902, [65, cfg.vocab_size], 8),
    Request(903, [65] * 8, 0),
    Request(904, [65] * 8, small * S.block),
]
small_cache = PagedKVCache(cfg, small, S.block, DEVICE, DTYPE)
try:
    next(serve(model, bad, small_cache, SCHEDULERS["continuous"]))
except ValueError as err:
    print(f"given up front, before any step: {err}")
late = fresh_requests(bad, [1e-3] * len(bad))  # they arrive once the others run
([with_refusals],) = take_turns(
    starter(
        SCHEDULERS["continuous"],
        stream[:4] + late,
        small,
        on_refused=lambda req, err: print(f"  refused: {err}"),
    )
)
print(f"{len(with_refusals.requests)} requests served, {len(with_refusals.refused)} refused")

# %%
# Throughput, all requests waiting at once
# ----------------------------------------
# All requests arrive at time 0 (offline). Three schedulers take turns:
# continuous, static, and static skipping finished slots. Each serves the
# stream at least ``runs`` times. The runs' ms per token (``ms_per_token``)
# give a median and an interquartile range (IQR), printed as tokens/s. A
# speedup is claimed only where the ranges do not overlap (``outside_noise``).
# The *slot bound* is static slot-steps over tokens: what idle slots cost. It
# reads like a :term:`work bound`, the speedup to expect if time followed work.
# Its :term:`fraction of the bound` is the measured speedup over it
# (:ref:`how to read it <fraction-of-the-bound>`). The slot bound leaves out
# two costs. One is the *tail*: fewer requests than slots, none waiting. The
# other is prompt tokens mixed into decode steps. Both are printed and drawn
# for the continuous run of median throughput.

from ragged_site.measuring.noise import MIN_RUNS, outside_noise
from ragged_site.serving.metrics import ms_per_token, rate_spread, slot_bound, speedup_claim
from ragged_site.records import record

assert S.runs >= MIN_RUNS, "the noise rule needs MIN_RUNS runs of each scheduler"
each_run = take_turns(*(starter(plan, stream) for plan in SCHEDULERS.values()), runs=S.runs)
offline = dict(zip(SCHEDULERS, each_run))
per_token = {name: ms_per_token(runs) for name, runs in offline.items()}
tokens_per_s = {name: 1e3 / spread.median_ms for name, spread in per_token.items()}
for scheduler, spread in per_token.items():
    print(f"{scheduler}: {rate_spread(spread)}")
W, *others = {round(slot_bound(run), 9) for run in offline["static"]}
assert not others, "static runs of the same requests took different steps"
R, P = tokens_per_s["continuous"], tokens_per_s["static"]
apart = outside_noise(per_token["continuous"], per_token["static"])
line = (
    f"serving: continuous {R:.0f} tokens/s, static {P:.0f} tokens/s, speedup {R / P:.2f}x, "
    f"slot bound {W:.2f}x, fraction {R / P / W:.2f}" + ("" if apart else " (within noise)")
)
rates = {"continuous": R, "static": P}
print(
    record(
        "serving",
        line,
        label="serving",
        tokens_per_s=rates,
        speedup=R / P,
        bound=W,
        fraction=R / P / W,
    )
)
skipping = outside_noise(per_token["continuous"], per_token["static, skipping"])
print(
    f"static that skips finished slots: {tokens_per_s['static, skipping']:.0f} tokens/s; continuous is "
    f"{R / tokens_per_s['static, skipping']:.2f}x that" + ("" if skipping else " (within noise)")
)
print("the speedup over static batches " + speedup_claim(apart, "their runs"))

import matplotlib.pyplot as plt
from ragged_site.figures import FIGURE_STYLE
from ragged_site.serving.metrics import draw_steps, step_costs

by_speed = sorted(offline["continuous"], key=lambda run: sum(st.seconds for st in run.steps))
steps = by_speed[len(by_speed) // 2].steps
cost = step_costs(steps, S.slots)
print(
    f"continuous: {len(steps)} steps, {cost['seconds']:.2f} s; the tail: {cost['tail_steps']} steps, "
    f"{cost['tail_seconds'] / cost['seconds']:.0%} of the time"
)
print(
    f"{cost['mixed_steps']} steps carried {cost['prompt_tokens']} prompt tokens: {cost['prompt_seconds']:.2f} s "
    f"more than as many decode-only steps ({cost['decode_step_s'] * 1e3:.2f} ms)"
)

plt.rcParams.update(FIGURE_STYLE)
draw_steps(steps, S.token_budget, f"Continuous batching, {S.requests} requests at once")
plt.show()

# %%
# Latency, requests arriving over time
# ------------------------------------
# Online, the same requests arrive one by one, Poisson-distributed, at ``LOAD``
# times the rate continuous batching served offline. A user sees the *time to
# first token*, from arrival: queuing, then prefill. After it, the user sees
# the *time per output token*. A static batch starts only when the one before
# has finished. Beside them, throughput: every run a point, the median a bar.

from ragged_site.serving.metrics import draw_throughput_and_latency, latency_ms
from ragged_site.workloads import poisson_arrivals

rate = LOAD * R / out_lengths.mean()  # requests/s
arriving = fresh_requests(
    stream, poisson_arrivals(np.random.default_rng(setup.seed + 1), S.requests, rate)
)
each_run = take_turns(*(starter(SCHEDULERS[name], arriving) for name in ("continuous", "static")))
online = dict(zip(("continuous", "static"), each_run))
latency = {
    name: latency_ms([req for run in runs for req in run.requests]) for name, runs in online.items()
}
for name, lat in latency.items():
    (ttft_p50, ttft_p99), (tpot_p50, tpot_p99) = lat["ttft"], lat["tpot"]  # each (p50, p99)
    line = (
        f"latency of {name} (arrivals at {rate:.1f} requests/s): time to first token p50 {ttft_p50:.0f} ms, "
        f"p99 {ttft_p99:.0f} ms; time per output token p50 {tpot_p50:.2f} ms, p99 {tpot_p99:.2f} ms"
    )
    figures = dict(ttft_ms=lat["ttft"], tpot_ms=lat["tpot"], requests_per_s=rate)  # (p50, p99) each
    print(record("latency", line, label=f"latency of {name}", **figures))

draw_throughput_and_latency(offline, latency, rate)
plt.show()

# %%
# Out of blocks
# -------------
# The same requests arrive all at once. The cache gets the memory a contiguous
# cache needs for ``contiguous_slots`` requests, each reserving the longest
# prompt and output. There is no limit on slots. Requests join while blocks are
# free, and the scheduler preempts as they grow. After every step, ``check``
# verifies that each block is free or held by one request. The count of
# concurrent requests is the median over the steps in which requests waited:
# then the cache held them back. A paged request holds rows beyond its tokens
# only in its last block. The cache at the step with the most requests and a
# block free:

memory_blocks = S.contiguous_slots * blocks_per_slot
unlimited = functools.partial(plan_continuous, max_running=S.requests, token_budget=S.token_budget)
from ragged_site.serving.batching import CacheSnapshots

snapshots = CacheSnapshots()  # after each step: block tables, free list, each request's keys in use
([paged_run],) = take_turns(
    starter(unlimited, stream, memory_blocks, check=True, observe=snapshots)
)
preempted = sum(req.preempted for req in paged_run.requests)
assert preempted > 0, "no request was preempted: the cache was never full"
concurrent = int(np.median([rec.running for rec in paged_run.steps if rec.waiting > 0]))
# each contiguous request reserves its longest length
contiguous = memory_blocks * S.block // (S.prompt_max + S.out_max)
in_use = np.mean(
    [rec.used_rows / (rec.held_blocks * S.block) for rec in paged_run.steps if rec.held_blocks]
)
# keys and values, from the shapes
mib = 2 * PagedKVCache(cfg, memory_blocks, S.block, "meta", DTYPE).k.nbytes / 2**20
print(
    f"paged KV cache: {concurrent} concurrent requests in {mib:.2f} MiB, "
    f"contiguous {contiguous}; {in_use:.0%} of allocated rows in use"
)
print(
    f"{preempted} preemptions of {sum(req.preempted > 0 for req in paged_run.requests)} requests; "
    f"{sum(rec.prefill for rec in paged_run.steps) - prompt_lengths.sum()} tokens recomputed; "
    f"at most {max(rec.running for rec in paged_run.steps)} requests at once"
)

from ragged_site.figures import draw_paged_cache

shot = snapshots.fullest()  # the step with the most requests and a block free
draw_paged_cache(shot["tables"], shot["free"], memory_blocks, S.block, shot["keys"])
plt.show()
# sphinx_gallery_thumbnail_number = 3

# %%
# Proof: every request equals decoding it alone
# ---------------------------------------------
# Every request of every run above is checked against decoding it alone in
# float32, without a cache. One padded pass over its prompt and generated
# tokens gives the reference logits. Greedy decoding alone chooses each
# token with them (teacher forcing). The server's logits must agree within
# the tolerance (``atol=0.1, rtol=0.05`` in a 16-bit dtype). Each token must
# be the reference's greedy choice, or tie with it within ``atol``. By
# induction on the tokens, each request generated what decoding it alone
# generates. ``tests/test_serving.py`` plants three classic bugs that this
# proof catches. One reads a block table one block off. One uses a freed
# block. One resumes a preempted request at the wrong position.
#
# .. literalinclude:: ../ragged_site/serving/proof.py
#    :pyobject: check_against_alone

from ragged_site.serving.proof import check_against_alone, check_runs_against_alone

checked = [run for runs in (*offline.values(), *online.values()) for run in runs] + [paged_run]
assert all(len(served.requests) == S.requests for served in checked)
worst, ties = check_runs_against_alone(reference, checked, PROOF_TOLERANCE, served_logits)
# the refusals disturbed nothing
check_against_alone(reference, with_refusals.requests, PROOF_TOLERANCE, served_logits)
print(
    f"every run, {str(DTYPE).removeprefix('torch.')}: every logit within "
    + ", ".join(f"{k} {v:g}" for k, v in PROOF_TOLERANCE.items())
    + " of decoding each request alone"
)
print(
    f"{len(checked)} runs (how many, and the online batches, follow the time): "
    f"largest difference {worst:.1e}, {ties} ties within atol"
)
print(
    f"requests: {S.requests}/{S.requests} finished, each equal to decoding it alone; preempted {preempted}"
)

# %%
# Conclusion
# ----------
# Continuous batching is the ragged batch at its most ragged. It has packed
# tokens, positions restarting per request, and attention within each request.
# On top comes bookkeeping: a free list, block tables, a token budget,
# preemption, a check at the door. The lines above say whether it beat static
# batches on this device, outside the noise. They say how much of the slot
# bound it reached, and how many more requests the paged cache held. They also
# say what it did to latency. The proof says that none of it changed a request.
#
# References
# ----------
# * Kwon et al., "Efficient Memory Management for Large Language Model
#   Serving with PagedAttention" (vLLM), 2023: https://arxiv.org/abs/2309.06180
# * Yu et al., "Orca" (iteration-level scheduling), OSDI 2022:
#   https://www.usenix.org/conference/osdi22/presentation/yu
# * Agrawal et al., "Sarathi-Serve" (chunked prefill), 2024: https://arxiv.org/abs/2403.02310
# * attention-gym's paged attention with FlexAttention: https://github.com/meta-pytorch/attention-gym
# * ``varlen_attn``: https://docs.pytorch.org/docs/stable/nn.attention.varlen.html
# * ``nano-vllm``: https://github.com/GeeeekExplorer/nano-vllm
