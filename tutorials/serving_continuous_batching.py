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
         request, and attention that reads each request's keys through its
         table
       * How a continuous-batching scheduler builds every step: decode
         tokens, prompt chunks under a token budget, admissions, and
         preemption when the cache is full
       * How to prove a server correct (every request equals decoding it
         alone) and measure it: throughput beside the slot bound, time to
         first token, time per output token, requests per MiB of cache

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
# the batch decodes until its longest sequence is done, and the cache
# reserves each sequence's rows up front. Servers (vLLM, SGLang, TGI,
# ``transformers``' continuous batching) do otherwise: at every step
# finished requests leave and waiting ones join, the prompts of newcomers
# are packed with the one decode token of each running request, and the
# cache is *paged*, so that memory follows the tokens in use. Every step
# is a new ragged batch.
#
# A paged cache cuts its rows into blocks of ``block_size``. A request
# holds a *block table*, the list of its blocks; its token at position
# ``p`` lives in row ``table[p // block_size] * block_size + p %
# block_size``. Blocks come from a free list and go back to it when the
# request leaves:
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: PagedKVCache
#
# Three requests of 6, 3 and 9 tokens in blocks of 4; the second leaves, and
# a fourth request gets its block:

import torch
from ragged_toolkit.gpt import GPTConfig
from ragged_toolkit.kv_cache import block_table_tensor, paged_rows, PagedKVCache

tiny_cfg = GPTConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=16,
                     max_seq_len=32)
demo = PagedKVCache(tiny_cfg, n_blocks=8, block_size=4, device="cpu", dtype=torch.float32)
for rid, n in ((0, 6), (1, 3), (2, 9)):
    assert demo.reserve(rid, n)
print(f"block tables {demo.tables}, free list {demo.free}")
demo.release(1)
assert demo.reserve(3, 4) and demo.tables[3] == [2]
demo.check()  # every block is free or in exactly one table
print(f"request 1 left, request 3 came: tables {demo.tables}, free list {demo.free}")
table = block_table_tensor(demo, [0, 2], "cpu")  # (B, max_blocks), what attention reads
rows = paged_rows(table, torch.tensor([6, 9]), demo.block_size)
assert rows.tolist() == [0, 1, 2, 3, 4, 5] + [12, 13, 14, 15, 16, 17, 18, 19, 20]
print(f"block table of requests 0 and 2: {table.tolist()}")
print(f"the rows of their keys: {rows.tolist()}")

# %%
# ``paged_rows`` is what attention reads through: the rows of every key
# each sequence of a step uses, from the step's block table.
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: paged_rows
#
# Sizes
# ~~~~~
# Every size is set here, per device; :term:`quick mode` shrinks them. The
# CPU sizes are chosen for a build of about a minute on two cores; servers run
# models of billions of weights, hundreds of requests at once, prompts of
# thousands of tokens and blocks of 16 rows (vLLM). On CUDA the blocks have
# 256 rows, the smallest that the paged kernel of FlashAttention takes.

import numpy as np
from ragged_toolkit.device import default_device, default_dtype, quick_mode, quiet_known_notes
from ragged_toolkit.measuring.timing import TIMING_THREADS

DEVICE = default_device()
DTYPE = default_dtype(DEVICE)
torch.set_num_threads(TIMING_THREADS)  # as every timing of the site: one thread
QUICK = quick_mode()
SEED = 0
if DEVICE == "cuda":
    MODEL = dict(vocab_size=256, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                 ffn_hidden=2816, max_seq_len=2048)
    REQUESTS, SLOTS, TOKEN_BUDGET, BLOCK = 128, 32, 512, 256
    PROMPT_MAX, OUT_MEDIAN, OUT_MAX, CONTIGUOUS_SLOTS = 512, 96, 512, 16
else:
    MODEL = dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                 ffn_hidden=352, max_seq_len=512)
    REQUESTS, SLOTS, TOKEN_BUDGET, BLOCK = 192, 16, 64, 16
    PROMPT_MAX, OUT_MEDIAN, OUT_MAX, CONTIGUOUS_SLOTS = 48, 32, 192, 8
if QUICK:
    MODEL.update(dict(dim=64, ffn_hidden=176) if DEVICE == "cpu" else dict(n_layers=2))
    REQUESTS, SLOTS, OUT_MEDIAN, OUT_MAX = REQUESTS // 4, SLOTS // 2, OUT_MEDIAN // 2, OUT_MAX // 4
    CONTIGUOUS_SLOTS //= 2
LOAD = 0.7  # online arrivals: this fraction of what continuous batching served offline
RUN_TIME = 0.1 if QUICK else 1.0 if DEVICE == "cuda" else 0.3  # s per timing
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}, quick: {QUICK}")
print("model: " + ", ".join(f"{k} {v}" for k, v in MODEL.items()))
print(f"{REQUESTS} requests, {SLOTS} slots, {TOKEN_BUDGET} tokens per step, "
      f"blocks of {BLOCK} rows")

# sphinx_gallery_start_ignore
quiet_known_notes()
# sphinx_gallery_end_ignore

# %%
# A stream of requests
# --------------------
# The prompts are openings of real documents, the docstrings of Python's
# standard library (bytes as tokens, as in :doc:`packed_gpt_training`). How
# many tokens each request generates is drawn from a log-normal distribution,
# long-tailed as chat outputs are, with a maximum, and fixed per request,
# as serving benchmarks fix it by ignoring the end-of-sequence token, so
# that every scheduler does the same work.
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: request_stream

from ragged_toolkit.data import docstring_corpus
from ragged_toolkit.serving.requests import request_stream

docs, source = docstring_corpus(min_chars=2)
rng = np.random.default_rng(SEED)
stream = request_stream(docs, REQUESTS, rng, prompt_max=PROMPT_MAX, out_median=OUT_MEDIAN,
                        out_max=OUT_MAX)
prompt_lengths = np.array([len(r.prompt) for r in stream])
out_lengths = np.array([r.n_out for r in stream])
print(f"prompts: openings of {source}, {prompt_lengths.min()} to {prompt_lengths.max()} "
      f"tokens, mean {prompt_lengths.mean():.1f}")
print(f"outputs: log-normal, median {OUT_MEDIAN}, sigma 1, cut to {OUT_MAX}: "
      f"{out_lengths.min()} to {out_lengths.max()} tokens, mean {out_lengths.mean():.1f}")

# %%
# The model is the GPT of :doc:`packed_gpt_training`, with random weights:
# a server's correctness and speed do not depend on what the weights
# learned, so this page does not train them (its generations are not text).
# A float32 copy of the same weights is the reference the proof uses.

from ragged_toolkit.gpt import GPT

cfg = GPTConfig(**MODEL)
torch.manual_seed(SEED)
model = GPT(cfg).to(DEVICE).eval()
reference = GPT(cfg).to(DEVICE).eval()
model = model.to(DTYPE)  # a server runs its weights in the low precision too
reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, untrained")

# %%
# Attention through the block table
# ---------------------------------
# A step of the server runs the GPT once on a packed batch of new tokens;
# its attention is told the batch's *layout*. ``PagedLayout`` writes each new
# key into its row (its *slot*) and hands attention the step's block table
# and how many keys each sequence uses:
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: PagedLayout
#
# Each new query attends causally to its own request's keys, and the new
# queries are the last of their request, so the causal mask is aligned
# bottom-right. Three ways to read the keys:
#
# * **gathered**: the rows ``paged_rows`` names, gathered into a packed
#   batch for ``ragged_attention`` (its default backend for the device);
# * **flex**: FlexAttention reads the whole cache in place, with a block
#   mask in which a query sees a row if its request owns the row, up to its
#   own position;
# * **varlen**: ``varlen_attn`` with ``block_table`` and ``seqused_k``
#   (the paged kernel of FlashAttention, CUDA only).
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: gathered_attention
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: paged_block_mask
#
# One step as the server builds it: ``SLOTS - 1`` requests decoding and a
# newcomer's prompt chunk. Each path runs the whole model on it and must
# give, for every request, the logits of running it alone without a cache,
# and the logits of the gathered path. Then they are timed (the first call,
# which compiles, apart), and ``choose`` takes the fastest only outside the
# noise, else the default, the gathered path.

import functools
import time

from ragged_toolkit.device import synchronize, tolerances
from ragged_toolkit.measuring.noise import choose
from ragged_toolkit.measuring.compiling import compile_counter
from ragged_toolkit.measuring.timing import measure
from ragged_toolkit.measuring.tables import print_timings
from ragged_toolkit.layouts import PaddedLayout
from ragged_toolkit.serving.engine import build_step, forward_step
from ragged_toolkit.serving.requests import fresh_requests
from ragged_toolkit.serving.paged_attention import paged_varlen_support

PROOF_TOLERANCE = tolerances(DTYPE) if DTYPE == torch.float32 else dict(atol=0.1, rtol=0.05)
blocks_per_slot = -(-(PROMPT_MAX + OUT_MAX) // BLOCK)  # a full-length request's blocks
bench_cache = PagedKVCache(cfg, SLOTS * blocks_per_slot, BLOCK, DEVICE, DTYPE)
bench = fresh_requests(stream[:SLOTS])
for req in bench:
    bench_cache.reserve(req.rid, len(req.prompt) + 1)
forward_step(model, bench_cache, [(req, req.pending()) for req in bench[:-1]])  # their prefill
chunk = min(len(bench[-1].prompt), TOKEN_BUDGET - (SLOTS - 1))
step_work = [(req, 1) for req in bench[:-1]] + [(bench[-1], chunk)]


@torch.no_grad()
def logits_after(tokens):
    """Decoding ``tokens`` alone, without a cache: one causal pass, padded layout."""
    ids = torch.tensor(tokens, device=DEVICE)[None]  # (1, S)
    return reference(ids, torch.arange(len(tokens), device=DEVICE)[None], PaddedLayout())[0, -1]


expected = torch.stack([logits_after((r.prompt + r.generated)[:r.computed + n])
                        for r, n in step_work])  # each request's history once this step has run


def step_logits(path):
    tokens, positions, layout = build_step(bench_cache, step_work, DEVICE, path)
    with torch.no_grad():
        return model(tokens, positions, layout)[layout.q_offsets[1:] - 1].float()  # (B, vocab)


PATHS = {"gathered": None, "flex": None, "varlen": paged_varlen_support(DEVICE, DTYPE, BLOCK)}
first_call_s, logits_of = {}, {}
with compile_counter() as compiled:
    for path in [p for p, why in PATHS.items() if why is None]:
        synchronize()
        start = time.perf_counter()
        logits_of[path] = step_logits(path)
        synchronize()
        first_call_s[path] = time.perf_counter() - start
        note = " (a known bug of paged split-KV: pytorch/pytorch#194167)" * (path == "varlen")
        for want, what in ((expected, "decoding alone"), (logits_of["gathered"], "gathered")):
            torch.testing.assert_close(logits_of[path], want, **PROOF_TOLERANCE, msg=lambda m:
                                       f"{path}{note}: step logits differ from {what}: {m}")
        PATHS[path] = functools.partial(step_logits, path)
timings = measure({p: fn for p, fn in PATHS.items() if callable(fn)}, min_run_time=RUN_TIME)
print_timings({p: timings.get(p, why) for p, why in PATHS.items()})
print("first calls: " + ", ".join(f"{p} {s:.2f} s" for p, s in first_call_s.items())
      + f"; torch.compile: {compiled}")
PATH = choose(timings, "gathered", f"paged attention on {DEVICE}")

# %%
# The scheduler
# -------------
# One engine serves both schedulers. A request's keys are those of its
# prompt and of what it generated; ``computed`` of them are in the cache.
# A step feeds each scheduled request its next tokens: a prompt chunk, a
# whole prompt, or the one token it generated last. When a request's whole
# history is in the cache, the step's logits give its next token, the greedy
# choice; so prefill, chunked prefill and decoding are one operation, and so
# is recomputing a preempted request.
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: forward_step
#
# Continuous batching plans every step anew: running requests first, in the
# order they were admitted, then newcomers while free blocks, free slots and
# the step's token budget allow, a prompt longer than what is left of the
# budget cut into chunks. When a running request needs a block and none is
# free, the most recently admitted request is *preempted*: its blocks go back
# to the free list, and it waits at the front of the queue to recompute its
# keys (the default of vLLM; swapping them to host memory is the alternative).
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: plan_continuous
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: preempt
#
# The baseline is static batching as a batched ``generate`` does it, with a
# packed prefill so that only the scheduling differs: a batch of ``SLOTS``
# requests starts together and decodes until its longest request is done.
# A finished request's slot idles: the step still computes a padding token
# there, as ``generate`` and a fixed-shape decoding step do.
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: plan_static
#
# ``serve`` runs a scheduler on a simulated clock that advances by each
# step's measured time (the step synchronized, then ``time.perf_counter``),
# so the page never sleeps: with nothing to run, the clock jumps to the next
# arrival. It is a generator, one step per turn, so that runs can take
# turns step by step (``take_turns``); a run that ends first starts again
# until the longest has ended, so that all span the same stretch of time and
# whatever else the machine does weighs on them alike.
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: serve

from ragged_toolkit.serving.schedulers import plan_continuous, plan_static, retire_batch
from ragged_toolkit.serving.server import serve, take_turns

serving_blocks = SLOTS * blocks_per_slot  # the same cache for both: SLOTS full-length requests
continuous = functools.partial(plan_continuous, max_running=SLOTS, token_budget=TOKEN_BUDGET)
static = functools.partial(plan_static, batch_size=SLOTS, reserve=OUT_MAX)
static_skipping = functools.partial(static, skip_finished=True)


def starter(plan, requests, n_blocks=serving_blocks, **kw):
    """What starts a run of ``serve``: fresh requests on a cache of their
    own; a static plan retires whole batches."""
    if plan.func is plan_static:
        kw["retire_step"] = retire_batch
    return lambda: serve(model, fresh_requests(requests),
                         PagedKVCache(cfg, n_blocks, BLOCK, DEVICE, DTYPE), plan, path=PATH, **kw)


# %%
# Throughput, all requests waiting at once
# ----------------------------------------
# All requests arrive at time 0 (offline throughput). Three schedulers take
# turns: continuous batching, static batching, and static batching that
# skips the finished requests' slots instead of computing them; each one's
# tokens per second count all its runs in that stretch. The *slot bound* is
# what the idle slots of the static scheduler cost: its slot-steps over the
# tokens it generated, the speedup a continuous scheduler with as many slots
# would reach if every step cost the same and had a full batch.

from ragged_toolkit.serving.metrics import slot_bound, tokens_per_second

offline = dict(zip(("continuous", "static", "static, skipping"),
                   take_turns(starter(continuous, stream), starter(static, stream),
                              starter(static_skipping, stream))))
speed = {name: tokens_per_second(runs) for name, runs in offline.items()}
R, P = speed["continuous"], speed["static"]
W = slot_bound(offline["static"][0])
print(f"serving: continuous {R:.0f} tokens/s, static {P:.0f} tokens/s, speedup {R / P:.2f}x, "
      f"slot bound {W:.2f}x, fraction {R / P / W:.2f}")
print(f"static that skips finished slots: {speed['static, skipping']:.0f} tokens/s; "
      f"continuous is {R / speed['static, skipping']:.2f}x that")
print("runs in the same stretch of time: "
      + ", ".join(f"{name} {len(runs)}" for name, runs in offline.items()))

# %%
# The bound counts only slots, so two costs of the continuous run are left
# out of it: the *tail*, steps at the end with fewer requests than slots and
# none waiting, and the prompt tokens mixed into decode steps (the static
# run has its prompts too, in steps of their own). What each cost here:

steps = offline["continuous"][0].steps
seconds = np.array([s.seconds for s in steps])
tail = np.array([s.running < SLOTS and s.waiting == 0 for s in steps])
mixed = np.array([s.prefill > 0 for s in steps])
decode_only = np.median(seconds[~mixed & ~tail]) if (~mixed & ~tail).any() else np.median(seconds)
print(f"continuous: {len(steps)} steps, {seconds.sum():.2f} s; the tail: {tail.sum()} steps, "
      f"{seconds[tail].sum() / seconds.sum():.0%} of the time")
print(f"{mixed.sum()} steps carried {sum(s.prefill for s in steps)} prompt tokens: "
      f"{seconds[mixed].sum() - mixed.sum() * decode_only:.2f} s more than as many decode-only "
      f"steps ({decode_only * 1e3:.2f} ms)")

# %%
# What a continuous batch holds, step by step: the prompt tokens of
# newcomers (chunked under the budget) on top of one decode token per
# running request, and the requests running and waiting.

import matplotlib.pyplot as plt
from ragged_toolkit.figures import FIGURE_STYLE

plt.rcParams.update(FIGURE_STYLE)
x = np.arange(len(steps))
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, layout="constrained")
decode = np.array([s.decode for s in steps])
ax1.bar(x, decode, width=1.0, color="C0", label="decode tokens")
ax1.bar(x, [s.prefill for s in steps], bottom=decode, width=1.0, color="C1",
        label="prompt tokens")
ax1.axhline(TOKEN_BUDGET, color="k", ls=":", label="token budget")
ax1.set(ylabel="tokens in the step", ylim=(0, 1.45 * TOKEN_BUDGET),
        title=f"Continuous batching, {REQUESTS} requests at once")
ax1.legend(loc="upper right", ncol=3)
ax2.step(x, [s.running for s in steps], where="mid", color="C2", label="running")
ax2.step(x, [s.waiting for s in steps], where="mid", color="C3", label="waiting")
ax2.set(xlabel="step", ylabel="requests")
ax2.legend(loc="upper right")
plt.show()

# %%
# Latency, requests arriving over time
# ------------------------------------
# Online, requests arrive one by one, Poisson-distributed, at ``LOAD`` times
# the rate continuous batching served them offline, the same requests for
# both schedulers. Two latencies matter to a user: the *time to first token*
# (from arrival: queuing and prefill) and the *time per output token* after
# it (how fast the answer streams).

from ragged_toolkit.serving.metrics import latency_ms
from ragged_toolkit.serving.requests import poisson_arrivals

rate = LOAD * R / out_lengths.mean()  # requests/s
arrivals = poisson_arrivals(np.random.default_rng(SEED + 1), REQUESTS, rate)
arriving = fresh_requests(stream, arrivals)
online = dict(zip(("continuous", "static"), take_turns(starter(continuous, arriving),
                                                      starter(static, arriving))))
latency = {name: latency_ms([r for run in runs for r in run.requests])
           for name, runs in online.items()}
for name, lat in latency.items():
    (a, b), (c, d) = lat["ttft"], lat["tpot"]
    print(f"latency of {name} (arrivals at {rate:.1f} requests/s): time to first token "
          f"p50 {a:.0f} ms, p99 {b:.0f} ms; time per output token p50 {c:.2f} ms, p99 {d:.2f} ms")

# %%
# A static batch starts only when the one before has finished, so newcomers
# queue behind its longest request; a continuous batch admits them at the
# next step. Throughput and latency side by side:

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 4.5), layout="constrained",
                               width_ratios=[1, 1.6])
ax1.bar(range(3), speed.values(), color=["C0", "C3", "C7"])
ax1.set_xticks(range(3), ["continuous", "static", "static,\nskipping"])
ax1.set(ylabel="generated tokens/s", title="All at once")
for i, (name, lat) in enumerate(latency.items()):
    values = [*lat["ttft"], *lat["tpot"]]
    ax2.bar(np.arange(4) + 0.4 * i - 0.2, values, 0.4, color=["C0", "C3"][i], label=name)
ax2.set_xticks(range(4), ["first\ntoken p50", "first\ntoken p99", "per token\np50",
                          "per token\np99"])
ax2.set(yscale="log", ylabel="ms", title=f"Arrivals at {rate:.1f} requests/s")
ax2.legend()
plt.show()

# %%
# Out of blocks
# -------------
# The same requests, all at once, in the memory a contiguous cache needs for
# ``CONTIGUOUS_SLOTS`` requests (each reserving room for the longest prompt
# and the longest output), now with no limit on slots: the cache alone
# decides how many requests run. Requests join while blocks are free, the
# cache fills as they grow, and the scheduler preempts. ``check`` verifies
# after every step that each block is free or held by exactly one request.

memory_blocks = CONTIGUOUS_SLOTS * blocks_per_slot
unlimited = functools.partial(plan_continuous, max_running=REQUESTS, token_budget=TOKEN_BUDGET)
snapshots = {}


def snapshot(step, running, cache):
    snapshots[step] = ({r.rid: list(cache.tables[r.rid]) for r in running},
                       {r.rid: r.computed for r in running}, list(cache.free))


[paged_run], = take_turns(starter(unlimited, stream, memory_blocks, check=True, observe=snapshot))
preempted = sum(r.preempted for r in paged_run.requests)
assert preempted > 0, "no request was preempted: the cache was never full"
concurrent = int(np.median([s.running for s in paged_run.steps if s.waiting > 0]))
contiguous = memory_blocks * BLOCK // (PROMPT_MAX + OUT_MAX)  # each reserves its longest length
in_use = np.mean([s.used_rows / (s.held_blocks * BLOCK) for s in paged_run.steps if s.held_blocks])
empty = PagedKVCache(cfg, memory_blocks, BLOCK, "meta", DTYPE)
mib = (empty.k.nbytes + empty.v.nbytes) / 2**20  # from the shapes
print(f"paged KV cache: {concurrent} concurrent requests in {mib:.2f} MiB, "
      f"contiguous {contiguous}; {in_use:.0%} of allocated rows in use")
print(f"{preempted} preemptions of {sum(r.preempted > 0 for r in paged_run.requests)} requests; "
      f"{sum(s.prefill for s in paged_run.steps) - prompt_lengths.sum()} tokens recomputed; "
      f"at most {max(s.running for s in paged_run.steps)} requests at once")

# %%
# The concurrent requests are the median of the steps in which requests
# waited (the cache, not the queue, held them back); the MiB are computed
# from the cache's shapes. The rows a paged request holds beyond its tokens
# are those of its last block; a contiguous cache holds each request's
# longest possible length. The cache at the step with the most requests
# running (and a block free), and the block tables of four of them:

with_free = [i for i in snapshots if snapshots[i][2]] or list(snapshots)  # a free block to show
step = max(with_free, key=lambda i: len(snapshots[i][0]))
tables, used, free = snapshots[step]
shown = sorted(tables, key=lambda r: -len(tables[r]))[:4]
per_row = 20
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), layout="constrained",
                               height_ratios=[-(-memory_blocks // per_row), len(shown)])
owner = {b: rid for rid, t in tables.items() for b in t}
for b in range(memory_blocks):
    rid = owner.get(b)
    color = "white" if rid is None else f"C{shown.index(rid)}" if rid in shown else "0.75"
    ax1.add_patch(plt.Rectangle((b % per_row, b // per_row), 0.92, 0.86, color=color, ec="0.5"))
    if rid in shown:
        ax1.text(b % per_row + 0.46, b // per_row + 0.43, str(tables[rid].index(b)),
                 ha="center", va="center", color="white")
ax1.set(xlim=(0, per_row), ylim=(-(-memory_blocks // per_row), 0), xticks=[], yticks=[],
        title=f"The cache at step {step}: {memory_blocks} blocks of {BLOCK} rows\nfour requests "
              f"(the logical block in each), {len(tables) - len(shown)} others (gray), "
              f"{len(free)} free (white)")
for i, rid in enumerate(shown):
    for j, b in enumerate(tables[rid]):
        ax2.add_patch(plt.Rectangle((j, i), 0.92, 0.86, color=f"C{i}"))
        ax2.text(j + 0.46, i + 0.43, str(b), ha="center", va="center", color="white")
ax2.set(xlim=(0, max(len(t) for t in tables.values())), ylim=(len(shown), 0), xticks=[],
        yticks=np.arange(len(shown)) + 0.43,
        yticklabels=[f"request {r}, {used[r]} keys" for r in shown],
        title="their block tables: the physical block of each logical block")
for side in ("top", "right", "bottom", "left"):
    ax1.spines[side].set_visible(False)
    ax2.spines[side].set_visible(False)
plt.show()

# sphinx_gallery_thumbnail_number = 3

# %%
# Proof: every request equals decoding it alone
# ---------------------------------------------
# Every request of every run above is checked against decoding it alone
# with the same weights in float32, with no cache and the plain padded
# layout (one causal SDPA call): one pass over its prompt and the tokens
# the server generated gives the logits that greedy decoding alone computes
# before each of them (teacher forcing). The server's logits must agree
# within the tolerance, and each of its tokens must be the reference's
# greedy choice (or tie with it within the tolerance). By induction on the
# tokens, the server then generated what decoding each request alone
# generates. In float32 the tolerance is that of every page. In a 16-bit
# dtype the server computes in low precision: its logits are compared
# teacher-forced within ``atol=0.1, rtol=0.05``, and where two tokens tie
# within that, "equal to decoding it alone" means equal within it.
#
# .. literalinclude:: ../ragged_toolkit/serving.py
#    :pyobject: check_against_alone

from ragged_toolkit.serving.proof import check_against_alone

checked = [run for runs in (*offline.values(), *online.values()) for run in runs] + [paged_run]
worst, ties = 0.0, 0
for served in checked:
    assert len(served.requests) == REQUESTS and all(r.done() for r in served.requests)
    difference, tied = check_against_alone(reference, served.requests, PROOF_TOLERANCE)
    worst, ties = max(worst, difference), ties + tied
criterion = ", ".join(f"{k} {v:g}" for k, v in PROOF_TOLERANCE.items())
print(f"every run, {DTYPE}: every logit within {criterion} of decoding each request alone")
print(f"{len(checked)} runs (how many, and the online batches, follow the time): "
      f"largest difference {worst:.1e}, {ties} ties within atol")
print(f"requests: {REQUESTS}/{REQUESTS} finished, each equal to decoding it alone; "
      f"preempted {preempted}")

# %%
# The tests of ``serving.py`` (``tests/test_serving.py``) plant three
# classic bugs and check that this proof catches each: a block table read
# one block off, a freed block still in use, and a preempted request that
# resumes at the wrong position.
#
# Conclusion
# ----------
# Continuous batching is the ragged batch at its most ragged, and it is
# built from the same pieces as the rest of the site: packed tokens with
# offsets, positions that restart per request, and attention within each
# request. What serving adds is bookkeeping: a free list, a block table per
# request, a token budget per step, and preemption when blocks run out.
# The lines above say, for this device and these sizes, how much of the
# slot bound continuous batching reached, how many more requests the paged
# cache held than a contiguous one in the same memory, and what each
# scheduler did to latency; the proof says that none of it changed what a
# request computes.
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
