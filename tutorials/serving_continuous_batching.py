"""
Serving ragged requests: continuous batching with a paged KV cache
==================================================================

Serve a stream of requests of different lengths the way inference servers
do: a scheduler that lets finished requests leave and waiting ones join at
every step, prompts packed with the decode tokens of the others, and a KV
cache in fixed-size blocks, proved against decoding each request alone and
measured against static batches.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How a paged KV cache works: blocks, a free list, a block table per
         request, and attention that reads each request's keys through it
       * How one step packs prompt chunks and decode tokens, how a
         continuous-batching scheduler plans every step (a token budget,
         admissions, preemption), and how a bad request is refused by name
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
# The decoding page runs one static batch: every sequence starts together,
# decodes until the longest is done, and reserves its rows up front.
# Servers (vLLM, SGLang, TGI, ``transformers``' continuous batching) do
# otherwise: at every step finished requests leave and waiting ones join,
# newcomers' prompts are packed with the decode token of each running
# request, and the cache is *paged*, so that memory follows the tokens in
# use. Every step is a new ragged batch.
#
# Every size is set here, per device; :term:`quick mode` shrinks them. The
# CPU sizes are chosen for a build of well under a minute on two cores;
# servers run models of billions of weights, hundreds of requests at once,
# prompts of thousands of tokens and blocks of 16 rows (vLLM). On CUDA the
# blocks have 256 rows, the smallest that the paged kernel of
# FlashAttention takes. ``runs``: how often each scheduler serves the stream.

from ragged_toolkit.device import page_setup

SIZES = {
    "cuda": dict(model=dict(vocab_size=256, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_hidden=2816,
                            max_seq_len=2048), requests=64, slots=32, token_budget=512, block=256,
                 prompt_max=512, out_median=96, out_max=512, contiguous_slots=16, runs=5, run_time=1.0),
    "cpu": dict(model=dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=352,
                           max_seq_len=512), requests=48, slots=16, token_budget=64, block=16,
                prompt_max=48, out_median=32, out_max=192, contiguous_slots=8, runs=5, run_time=0.3),
    "quick": dict(model=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176), requests=12,
                  slots=8, out_median=16, out_max=48, contiguous_slots=4, run_time=0.1),
}
setup = page_setup(SIZES)
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
LOAD = 0.7  # online arrivals: this fraction of what continuous batching served offline
print("model: " + ", ".join(f"{k} {v}" for k, v in S.model.items()))
print(f"{S.requests} requests, {S.slots} slots, {S.token_budget} tokens per step, blocks of {S.block} rows")

# %%
# A paged KV cache
# ----------------
# A paged cache cuts its rows into blocks of ``block_size``. A request
# holds a *block table*, the list of its blocks; its token at position
# ``p`` lives in row ``table[p // block_size] * block_size + p %
# block_size``. Blocks come from a free list and go back to it when the
# request leaves:
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: PagedKVCache
#
# Three requests of 6, 3 and 9 tokens in blocks of 4; the second leaves, and
# a fourth request gets its block:

import torch
from ragged_toolkit.gpt import GPTConfig
from ragged_toolkit.kv_cache import block_table_tensor, paged_rows, PagedKVCache

tiny_cfg = GPTConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=16, max_seq_len=32)
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
# ``paged_rows`` is what attention reads through: the rows of every key
# each sequence of a step uses, from the step's block table.
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: paged_rows
#
# A stream of requests
# --------------------
# The prompts are openings of the docstrings of Python's standard library
# (bytes as tokens, as in :doc:`packed_gpt_training`). Each request's
# output length is drawn from a long-tailed log-normal distribution, and
# fixed, as serving benchmarks fix it by ignoring the end-of-sequence
# token, so that every scheduler does the same work.
#
# .. literalinclude:: ../ragged_toolkit/serving/requests.py
#    :pyobject: request_stream

import numpy as np
from ragged_toolkit.data import docstring_corpus
from ragged_toolkit.serving.requests import request_stream

docs, source = docstring_corpus(min_chars=2)
rng = np.random.default_rng(setup.seed)
stream = request_stream(docs, S.requests, rng, prompt_max=S.prompt_max, out_median=S.out_median,
                        out_max=S.out_max)
prompt_lengths = np.array([len(req.prompt) for req in stream])
out_lengths = np.array([req.n_out for req in stream])
print(f"prompts: openings of {source}, {prompt_lengths.min()} to {prompt_lengths.max()} "
      f"tokens, mean {prompt_lengths.mean():.1f}")
print(f"outputs: log-normal, median {S.out_median}, sigma 1, cut to {S.out_max}: "
      f"{out_lengths.min()} to {out_lengths.max()} tokens, mean {out_lengths.mean():.1f}")

# %%
# The model is the GPT of :doc:`packed_gpt_training`, untrained: a server's
# correctness and speed do not depend on what the weights learned.
# A float32 copy of the same weights is the proof's reference.

from ragged_toolkit.gpt import GPT

cfg = GPTConfig(**S.model)
model = GPT(cfg).to(DEVICE).eval()
reference = GPT(cfg).to(DEVICE).eval()
model = model.to(DTYPE)  # a server runs its weights in the low precision too
reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
print(f"{sum(w.numel() for w in model.parameters()) / 1e6:.2f} M parameters, untrained")

# %%
# One step: prompt chunks and decode tokens together
# --------------------------------------------------
# A step runs the GPT once on a packed batch of new tokens: a decoding
# request brings the token it generated last, a newcomer a chunk of its
# prompt. ``computed`` of a request's history (``prompt + generated``)
# already has keys in the cache, so its next ``n`` tokens start there.
# ``build_step`` packs them: tokens, positions (restarting per request), the
# cache row (*slot*) of each new key, each request's keys in use and block
# table, and what the attention path needs, built once for every layer.
#
# .. literalinclude:: ../ragged_toolkit/serving/engine.py
#    :pyobject: build_step
#
# One step as the server builds it: ``slots - 1`` requests decoding, a
# newcomer's prompt chunk:

from ragged_toolkit.device import tolerances
from ragged_toolkit.serving.engine import build_step, forward_step
from ragged_toolkit.serving.requests import fresh_requests

PROOF_TOLERANCE = tolerances(DTYPE) if DTYPE == torch.float32 else dict(atol=0.1, rtol=0.05)
blocks_per_slot = -(-(S.prompt_max + S.out_max) // S.block)  # a full-length request's blocks
bench_cache = PagedKVCache(cfg, S.slots * blocks_per_slot, S.block, DEVICE, DTYPE)
bench = fresh_requests(stream[:S.slots])
for req in bench:
    bench_cache.reserve(req.rid, len(req.prompt) + 1)
forward_step(model, bench_cache, [(req, req.pending()) for req in bench[:-1]])  # their prefill
chunk = min(len(bench[-1].prompt), S.token_budget - (S.slots - 1))
step_work = [(req, 1) for req in bench[:-1]] + [(bench[-1], chunk)]
tokens, positions, layout = build_step(bench_cache, step_work, DEVICE)
assert layout.q_offsets.diff().tolist() == [1] * (S.slots - 1) + [chunk]  # packed in the work's order
kv_used = layout.kv_lengths.tolist()
print(f"one step, {len(tokens)} tokens: {S.slots - 1} decode tokens, then a prompt chunk of {chunk} at positions "
      f"{int(positions[-chunk])} to {int(positions[-1])};\nkeys in use per request {min(kv_used)} to "
      f"{max(kv_used)}, block table {tuple(layout.block_table.shape)}")

# %%
# Attention through the block table
# ---------------------------------
# The model's attention is told the step's *layout*: ``PagedLayout`` writes
# each new key into its slot and hands attention the step's block table.
#
# .. literalinclude:: ../ragged_toolkit/serving/paged_attention.py
#    :pyobject: PagedLayout
#
# A new query sees its own request's keys up to its position (the causal
# mask aligned bottom-right). Three ways to read them: **gathered**, the
# rows ``paged_rows`` names gathered into a packed batch for
# ``ragged_attention`` with the step's plan; **flex**, FlexAttention over
# the whole cache in place, with a block mask in which a query sees the rows
# its request owns; **varlen**, ``varlen_attn`` reading the cache in place
# through ``block_table`` (the paged kernel of FlashAttention, CUDA only).
#
# .. literalinclude:: ../ragged_toolkit/serving/paged_attention.py
#    :pyobject: gathered_attention
#
# .. literalinclude:: ../ragged_toolkit/serving/paged_attention.py
#    :pyobject: paged_block_mask
#
# .. literalinclude:: ../ragged_toolkit/serving/paged_attention.py
#    :pyobject: varlen_paged_attention
#
# Each path runs the whole model on the step above, timed (the first call,
# which compiles, apart), and must give every request the logits of running
# it alone without a cache; ``choose`` takes the fastest only outside the
# noise, else the default, the gathered path.

import functools

from ragged_toolkit.layouts import PaddedLayout
from ragged_toolkit.measuring.compiling import compile_counter
from ragged_toolkit.measuring.noise import choose
from ragged_toolkit.measuring.tables import print_timings
from ragged_toolkit.measuring.timing import measure
from ragged_toolkit.serving.paged_attention import paged_varlen_support


@torch.no_grad()
def logits_after(history):
    """Decoding ``history`` alone, without a cache: one causal pass, padded layout."""
    ids = torch.tensor(history, device=DEVICE)[None]  # (1, S)
    return reference(ids, torch.arange(len(history), device=DEVICE)[None], PaddedLayout())[0, -1]


@torch.no_grad()
def step_logits(path):
    tokens, positions, layout = build_step(bench_cache, step_work, DEVICE, path)
    return model(tokens, positions, layout)[layout.q_offsets[1:] - 1].float()  # (B, vocab)


expected = torch.stack([logits_after((req.prompt + req.generated)[:req.computed + n])
                        for req, n in step_work])  # each request's history once this step has run
PATHS = {"gathered": None, "flex": None, "varlen": paged_varlen_support(DEVICE, DTYPE, S.block)}
runnable = {path: functools.partial(step_logits, path) for path, why in PATHS.items() if why is None}
with compile_counter() as compiled:
    timings = measure(runnable, min_run_time=S.run_time, profile=not setup.quick)
print_timings({p: timings.get(p, why) for p, why in PATHS.items()})
print("first calls: " + ", ".join(f"{p} {timings[p].first_call_s:.2f} s" for p in runnable)
      + f"; torch.compile: {compiled}")
for path, logits_of in runnable.items():
    note = " (a known bug of paged split-KV: pytorch/pytorch#194167)" * (path == "varlen")
    for want, what in ((expected, "decoding alone"), (step_logits("gathered"), "gathered")):
        torch.testing.assert_close(logits_of(), want, **PROOF_TOLERANCE,
                                   msg=lambda m: f"{path}{note}: step logits differ from {what}: {m}")
PATH = choose(timings, "gathered", f"paged attention on {DEVICE}")

# %%
# The scheduler
# -------------
# One engine serves every scheduler: ``forward_step`` runs a step and gives
# each request whose history is then all in the cache its next token, the
# greedy choice: prefill, chunked prefill, decoding and recomputing a
# preempted request are one operation.
#
# .. literalinclude:: ../ragged_toolkit/serving/engine.py
#    :pyobject: forward_step
#
# Continuous batching plans every step anew: running requests first, in
# admission order, then newcomers while blocks, slots and the token budget
# allow, a long prompt cut into chunks. When a running request needs a
# block and none is free, the most recently admitted is *preempted*: its
# blocks are freed, and it waits at the front of the queue to recompute its
# keys (the default of vLLM; swapping to host memory is the alternative).
#
# .. literalinclude:: ../ragged_toolkit/serving/schedulers.py
#    :pyobject: plan_continuous
#
# .. literalinclude:: ../ragged_toolkit/serving/schedulers.py
#    :pyobject: preempt
#
# The baseline is static batching as a batched ``generate`` does it, with a
# packed prefill so that only the scheduling differs: ``slots`` requests
# start together and decode until the longest is done, a finished
# request's slot computing a padding token, as ``generate`` does.
#
# .. literalinclude:: ../ragged_toolkit/serving/schedulers.py
#    :pyobject: plan_static
#
# ``serve`` runs a scheduler on a simulated clock that advances by each
# step's measured time (``stopwatch``), so the page never sleeps: with
# nothing to run, the clock jumps to the next arrival. It is a generator,
# one step per turn, so that runs take turns step by step (``take_turns``);
# a run that ends starts again until each has ended ``runs`` times, so that
# whatever else the machine does weighs on all alike.
#
# .. literalinclude:: ../ragged_toolkit/serving/server.py
#    :pyobject: serve

from ragged_toolkit.serving.schedulers import plan_continuous, plan_static, retire_batch
from ragged_toolkit.serving.server import serve, take_turns

serving_blocks = S.slots * blocks_per_slot  # the same cache for all: ``slots`` full-length requests
SCHEDULERS = {"continuous": functools.partial(plan_continuous, max_running=S.slots, token_budget=S.token_budget),
              "static": functools.partial(plan_static, batch_size=S.slots, reserve=S.out_max),
              "static, skipping": functools.partial(plan_static, batch_size=S.slots, reserve=S.out_max,
                                                    skip_finished=True)}


def starter(plan, requests, n_blocks=serving_blocks, **kw):
    """What starts a run of ``serve``: fresh requests on a cache of their
    own; a static plan retires whole batches."""
    if plan.func is plan_static:
        kw["retire_step"] = retire_batch
    return lambda: serve(model, fresh_requests(requests), PagedKVCache(cfg, n_blocks, S.block, DEVICE, DTYPE),
                         plan, path=PATH, **kw)


# %%
# Requests the server cannot serve
# --------------------------------
# An empty prompt, an output length below one, a token id outside the
# vocabulary, more positions than the model has, more tokens than the whole
# cache holds: ``check_request`` refuses each by name, with the limit it
# breaks, before any step the request could join runs.
#
# .. literalinclude:: ../ragged_toolkit/serving/requests.py
#    :pyobject: check_request
#
# Given a batch up front, ``serve`` checks all of it before its first step.
# With ``on_refused`` it checks each request on arrival, sets a bad one
# aside, and the requests running go on (the proof below covers them too):

from ragged_toolkit.serving.requests import Request

small = blocks_per_slot  # a cache for one full-length request, with preemption for more
bad = [Request(900, [], 8), Request(901, [65] * 8, cfg.max_seq_len), Request(902, [65, cfg.vocab_size], 8),
       Request(903, [65] * 8, 0), Request(904, [65] * 8, small * S.block)]
try:
    next(serve(model, bad, PagedKVCache(cfg, small, S.block, DEVICE, DTYPE), SCHEDULERS["continuous"]))
except ValueError as err:
    print(f"given up front, before any step: {err}")
late = fresh_requests(bad, [1e-3] * len(bad))  # they arrive once the others run
[with_refusals], = take_turns(starter(SCHEDULERS["continuous"], stream[:4] + late, small,
                                      on_refused=lambda req, err: print(f"  refused: {err}")))
print(f"{len(with_refusals.requests)} requests served, {len(with_refusals.refused)} refused")

# %%
# Throughput, all requests waiting at once
# ----------------------------------------
# All requests arrive at time 0 (offline throughput). Three schedulers take
# turns (continuous, static, and static skipping finished slots), each
# serving the stream at least ``runs`` times. The runs' milliseconds per
# generated token (``ms_per_token``) give a median and an IQR, printed as
# tokens per second; a speedup is claimed only where two interquartile
# ranges do not overlap (``outside_noise``, the site's noise rule). The
# *slot bound*, the static batches' slot-steps over their tokens, is what
# idle slots cost; its :ref:`fraction <fraction-of-the-bound>` reads as a
# work bound's.

from ragged_toolkit.measuring.noise import MIN_RUNS, outside_noise
from ragged_toolkit.serving.metrics import ms_per_token, slot_bound

assert S.runs >= MIN_RUNS, "the noise rule needs MIN_RUNS runs of each scheduler"
offline = dict(zip(SCHEDULERS, take_turns(*(starter(plan, stream) for plan in SCHEDULERS.values()),
                                          runs=S.runs)))
per_token = {name: ms_per_token(runs) for name, runs in offline.items()}
tokens_per_s = {name: 1e3 / spread.median_ms for name, spread in per_token.items()}
for scheduler, spread in per_token.items():
    print(f"{scheduler}: median {tokens_per_s[scheduler]:.0f} tokens/s, IQR {1e3 / spread.q3_ms:.0f}-"
          f"{1e3 / spread.q1_ms:.0f}, over {spread.runs} runs")
slot_bounds = {round(slot_bound(run), 9) for run in offline["static"]}
assert len(slot_bounds) == 1, "static runs of the same requests took different steps"
W = slot_bounds.pop()
R, P = tokens_per_s["continuous"], tokens_per_s["static"]
apart = outside_noise(per_token["continuous"], per_token["static"])
print(f"serving: continuous {R:.0f} tokens/s, static {P:.0f} tokens/s, speedup {R / P:.2f}x, "
      f"slot bound {W:.2f}x, fraction {R / P / W:.2f}" + ("" if apart else " (within noise)"))
skipping = outside_noise(per_token["continuous"], per_token["static, skipping"])
print(f"static that skips finished slots: {tokens_per_s['static, skipping']:.0f} tokens/s; continuous is "
      f"{R / tokens_per_s['static, skipping']:.2f}x that" + ("" if skipping else " (within noise)"))
print("the speedup over static batches " + ("stands: the IQRs of their runs do not overlap" if apart else
                                           "is not claimed: the IQRs of their runs overlap"))

# %%
# The bound counts only slots, leaving out two costs: the *tail* (steps with
# fewer requests than slots and none waiting) and the prompt tokens mixed
# into decode steps. Each, in the continuous run of median throughput:

by_speed = sorted(offline["continuous"], key=lambda run: sum(st.seconds for st in run.steps))
steps = by_speed[len(by_speed) // 2].steps
seconds = np.array([st.seconds for st in steps])
tail = np.array([st.running < S.slots and st.waiting == 0 for st in steps])
mixed = np.array([st.prefill > 0 for st in steps])
decode_only = np.median(seconds[~mixed & ~tail]) if (~mixed & ~tail).any() else np.median(seconds)
print(f"continuous: {len(steps)} steps, {seconds.sum():.2f} s; the tail: {tail.sum()} steps, "
      f"{seconds[tail].sum() / seconds.sum():.0%} of the time")
print(f"{mixed.sum()} steps carried {sum(st.prefill for st in steps)} prompt tokens: "
      f"{seconds[mixed].sum() - mixed.sum() * decode_only:.2f} s more than as many decode-only "
      f"steps ({decode_only * 1e3:.2f} ms)")

# %%
# What that run's batch held, step by step: newcomers' prompt tokens over
# one decode token per running request, and the requests running and waiting.

import matplotlib.pyplot as plt
from ragged_toolkit.figures import FIGURE_STYLE

plt.rcParams.update(FIGURE_STYLE)
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, layout="constrained")
number, decoded = np.arange(len(steps)), np.array([rec.decode for rec in steps])
ax1.bar(number, decoded, width=1.0, color="C0", label="decode tokens")
ax1.bar(number, [rec.prefill for rec in steps], bottom=decoded, width=1.0, color="C1", label="prompt tokens")
ax1.axhline(S.token_budget, color="k", ls=":", label="token budget")
ax1.set(ylabel="tokens in the step", ylim=(0, 1.45 * S.token_budget),
        title=f"Continuous batching, {S.requests} requests at once")
ax1.legend(loc="upper right", ncol=3)
ax2.step(number, [rec.running for rec in steps], where="mid", color="C2", label="running")
ax2.step(number, [rec.waiting for rec in steps], where="mid", color="C3", label="waiting")
ax2.set(xlabel="step", ylabel="requests")
ax2.legend(loc="upper right")
plt.show()

# %%
# Latency, requests arriving over time
# ------------------------------------
# Online, the same requests arrive one by one, Poisson-distributed, at
# ``LOAD`` times the rate continuous batching served offline. Two latencies
# matter to a user: the *time to first token* (from arrival: queuing and
# prefill) and the *time per output token* after it.

from ragged_toolkit.serving.metrics import latency_ms
from ragged_toolkit.serving.requests import poisson_arrivals

rate = LOAD * R / out_lengths.mean()  # requests/s
arrivals = poisson_arrivals(np.random.default_rng(setup.seed + 1), S.requests, rate)
arriving = fresh_requests(stream, arrivals)
online = dict(zip(("continuous", "static"), take_turns(starter(SCHEDULERS["continuous"], arriving),
                                                      starter(SCHEDULERS["static"], arriving))))
latency = {name: latency_ms([req for run in runs for req in run.requests]) for name, runs in online.items()}
for name, lat in latency.items():
    (ttft_p50, ttft_p99), (tpot_p50, tpot_p99) = lat["ttft"], lat["tpot"]  # each (p50, p99)
    print(f"latency of {name} (arrivals at {rate:.1f} requests/s): time to first token p50 {ttft_p50:.0f} ms, "
          f"p99 {ttft_p99:.0f} ms; time per output token p50 {tpot_p50:.2f} ms, p99 {tpot_p99:.2f} ms")

# %%
# A static batch starts only when the one before has finished, so newcomers
# queue behind its longest request. Throughput (every run a point, the
# median a bar) and latency side by side:

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 4.5), layout="constrained", width_ratios=[1, 1.6])
for col, (scheduler, spread) in enumerate(per_token.items()):
    each = [sum(q.n_out for q in one.requests) / sum(st.seconds for st in one.steps) for one in offline[scheduler]]
    ax1.plot([col] * len(each), each, "o", color=["C0", "C3", "C7"][col], alpha=0.6)
    ax1.plot([col - 0.3, col + 0.3], [1e3 / spread.median_ms] * 2, color="k")
ax1.set_xticks(range(3), ["continuous", "static", "static,\nskipping"])
ax1.set(ylabel="generated tokens/s", ylim=(0, None), title="All at once, every run")
for col, (scheduler, lat) in enumerate(latency.items()):
    ax2.bar(np.arange(4) + 0.4 * col - 0.2, [*lat["ttft"], *lat["tpot"]], 0.4, color=["C0", "C3"][col],
            label=scheduler)
ax2.set_xticks(range(4), ["first\ntoken p50", "first\ntoken p99", "per token\np50", "per token\np99"])
ax2.set(yscale="log", ylabel="ms", title=f"Arrivals at {rate:.1f} requests/s")
ax2.legend()
plt.show()

# %%
# Out of blocks
# -------------
# The same requests, all at once, in the memory a contiguous cache needs for
# ``contiguous_slots`` requests (each reserving the longest prompt and
# output), with no limit on slots: the cache alone decides how many run.
# Requests join while blocks are free, the cache fills as they grow, and
# the scheduler preempts; ``check`` verifies after every step that each
# block is free or held by exactly one request.

memory_blocks = S.contiguous_slots * blocks_per_slot
unlimited = functools.partial(plan_continuous, max_running=S.requests, token_budget=S.token_budget)
snapshots = {}


def snapshot(step, running, cache):
    snapshots[step] = dict(tables={req.rid: list(cache.tables[req.rid]) for req in running},
                           used={req.rid: req.computed for req in running}, free=list(cache.free))


[paged_run], = take_turns(starter(unlimited, stream, memory_blocks, check=True, observe=snapshot))
preempted = sum(req.preempted for req in paged_run.requests)
assert preempted > 0, "no request was preempted: the cache was never full"
concurrent = int(np.median([rec.running for rec in paged_run.steps if rec.waiting > 0]))
contiguous = memory_blocks * S.block // (S.prompt_max + S.out_max)  # each reserves its longest length
in_use = np.mean([rec.used_rows / (rec.held_blocks * S.block) for rec in paged_run.steps if rec.held_blocks])
empty = PagedKVCache(cfg, memory_blocks, S.block, "meta", DTYPE)
mib = (empty.k.nbytes + empty.v.nbytes) / 2**20  # from the shapes
print(f"paged KV cache: {concurrent} concurrent requests in {mib:.2f} MiB, "
      f"contiguous {contiguous}; {in_use:.0%} of allocated rows in use")
print(f"{preempted} preemptions of {sum(req.preempted > 0 for req in paged_run.requests)} requests; "
      f"{sum(rec.prefill for rec in paged_run.steps) - prompt_lengths.sum()} tokens recomputed; "
      f"at most {max(rec.running for rec in paged_run.steps)} requests at once")

# %%
# The concurrent requests are the median of the steps in which requests
# waited (the cache, not the queue, held them back); the MiB come from the
# cache's shapes. A paged request holds rows beyond its tokens only in its
# last block; a contiguous cache holds each request's longest length. The
# cache at the step with the most requests running (and a block free), and
# the block tables of four of them:

with_free = [at for at in snapshots if snapshots[at]["free"]] or list(snapshots)  # a free block to show
shot = snapshots[max(with_free, key=lambda at: len(snapshots[at]["tables"]))]
shown = sorted(shot["tables"], key=lambda rid: -len(shot["tables"][rid]))[:4]
per_row, owner = 20, {b: rid for rid, blocks in shot["tables"].items() for b in blocks}
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), layout="constrained",
                               height_ratios=[-(-memory_blocks // per_row), len(shown)])
for b in range(memory_blocks):
    rid = owner.get(b)
    color = "white" if rid is None else f"C{shown.index(rid)}" if rid in shown else "0.75"
    ax1.add_patch(plt.Rectangle((b % per_row, b // per_row), 0.92, 0.86, color=color, ec="0.5"))
    if rid in shown:
        ax1.text(b % per_row + 0.46, b // per_row + 0.43, str(shot["tables"][rid].index(b)),
                 ha="center", va="center", color="white")
ax1.set(xlim=(0, per_row), ylim=(-(-memory_blocks // per_row), 0), xticks=[], yticks=[],
        title=f"The cache: {memory_blocks} blocks of {S.block} rows\nfour requests (the logical block in "
              f"each), {len(shot['tables']) - len(shown)} others (gray), {len(shot['free'])} free (white)")
for row, rid in enumerate(shown):
    for j, b in enumerate(shot["tables"][rid]):
        ax2.add_patch(plt.Rectangle((j, row), 0.92, 0.86, color=f"C{row}"))
        ax2.text(j + 0.46, row + 0.43, str(b), ha="center", va="center", color="white")
ax2.set(xlim=(0, max(map(len, shot["tables"].values()))), ylim=(len(shown), 0), xticks=[],
        yticks=np.arange(len(shown)) + 0.43, title="their block tables: the physical block of each logical block",
        yticklabels=[f"request {rid}, {shot['used'][rid]} keys" for rid in shown])
for ax in (ax1, ax2):
    ax.spines[:].set_visible(False)
plt.show()

# sphinx_gallery_thumbnail_number = 3

# %%
# Proof: every request equals decoding it alone
# ---------------------------------------------
# Every request of every run above is checked against decoding it alone
# with the same weights in float32, no cache, the plain padded layout: one
# pass over its prompt and the tokens the server generated gives the logits
# greedy decoding alone computes before each of them (teacher forcing). The
# server's logits must agree within the tolerance, and each of its tokens
# must be the reference's greedy choice (or tie with it within the
# tolerance); by induction on the tokens, the server generated what
# decoding each request alone generates. In a 16-bit dtype the logits are
# compared within ``atol=0.1, rtol=0.05``, and "equal" means equal within it.
#
# .. literalinclude:: ../ragged_toolkit/serving/proof.py
#    :pyobject: check_against_alone

from ragged_toolkit.serving.proof import check_against_alone

checked = [run for runs in (*offline.values(), *online.values()) for run in runs] + [paged_run]
worst, ties = 0.0, 0
for served in checked:
    assert len(served.requests) == S.requests and all(req.done() for req in served.requests)
    difference, tied = check_against_alone(reference, served.requests, PROOF_TOLERANCE)
    worst, ties = max(worst, difference), ties + tied
check_against_alone(reference, with_refusals.requests, PROOF_TOLERANCE)  # the refusals disturbed nothing
print(f"every run, {str(DTYPE).removeprefix('torch.')}: every logit within "
      + ", ".join(f"{k} {v:g}" for k, v in PROOF_TOLERANCE.items()) + " of decoding each request alone")
print(f"{len(checked)} runs (how many, and the online batches, follow the time): "
      f"largest difference {worst:.1e}, {ties} ties within atol")
print(f"requests: {S.requests}/{S.requests} finished, each equal to decoding it alone; preempted {preempted}")

# %%
# The tests of the serving modules (``tests/test_serving.py``) plant three
# classic bugs that this proof must catch (a block table read one block
# off, a freed block still in use, a preempted request resuming at the
# wrong position), and send each kind of bad request, up front and late.
#
# Conclusion
# ----------
# Continuous batching is the ragged batch at its most ragged, built from
# the site's pieces (packed tokens, positions restarting per request,
# attention within each) plus bookkeeping: a free list, block tables, a
# token budget, preemption, a check at the door. The lines above say, for
# this device and these sizes, whether it beat static batches outside the
# noise of repeated runs, how much of the slot bound it reached, how many
# more requests the paged cache held, and what each scheduler did to
# latency; the proof says none of it changed a request.
#
# References
# ----------
# * Kwon et al., "Efficient Memory Management for Large Language Model
#   Serving with PagedAttention" (vLLM), 2023: https://arxiv.org/abs/2309.06180
# * Yu et al., "Orca: A Distributed Serving System for Transformer-Based
#   Generative Models" (iteration-level scheduling), OSDI 2022:
#   https://www.usenix.org/conference/osdi22/presentation/yu
# * Agrawal et al., "Sarathi-Serve" (chunked prefill), 2024:
#   https://arxiv.org/abs/2403.02310
# * attention-gym's paged attention with FlexAttention:
#   https://github.com/meta-pytorch/attention-gym
# * ``varlen_attn``: https://docs.pytorch.org/docs/stable/nn.attention.varlen.html
# * ``nano-vllm``: https://github.com/GeeeekExplorer/nano-vllm
