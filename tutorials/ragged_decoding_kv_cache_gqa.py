"""
Decoding ragged batches: a KV cache, grouped-query attention and varlen attention
=================================================================================

Generate from a batch of prompts of different lengths with a key/value cache
in which every sequence keeps its own length, prove every step against a
recomputation, shrink the cache with grouped-query attention, and see which
attention kernel serves each decoding step on the device at hand.

**Author:** the ragged-transformers tutorial contributors, building on the
transformer building blocks tutorial by
`Mikayla Gawarecki <https://github.com/mikaylagawarecki>`_

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Why a KV cache for a ragged batch is a packed batch with spare
         rows, read with ``ragged_attention``'s ``kv_used``, and how to prove
         every cached step correct
       * What the cache costs in memory, what grouped-query attention (GQA)
         saves, and which kernel ran each decoding step
       * How to decode with FlexAttention without rebuilding its block mask
         at every step, and where ``varlen_attn`` fits

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_building_blocks` (packed values, offsets,
         ``ragged_attention``) and the model of :doc:`packed_gpt_training`,
         both from the site's module ``ragged_toolkit``
         (:doc:`reference </toolkit>`)
       * PyTorch 2.11 or later; ``varlen_attn`` needs a CUDA GPU of compute
         capability 8.0 or newer, and the page says what runs without one
"""

# sphinx_gallery_tags = ["KV cache", "GQA", "varlen attention", "FlexAttention", "decoding"]

# %%
# A KV cache is a packed batch with spare rows
# --------------------------------------------
# While decoding, each sequence adds one token per step, and that token's
# query must see the keys and values of everything before it. A cache with
# room for ``capacity`` tokens per sequence, seen as packed rows
# ``(B * capacity, H_kv, D)``, is a packed batch whose offsets are
# ``capacity`` apart: sequence ``b`` owns rows ``b * capacity ...``, and uses
# the first ``kv_used[b]`` of them (``seqused_k`` in ``varlen_attn``). Three
# sequences with 3, 1 and 4 cached tokens, one new query each, four query
# heads sharing two key/value heads; the spare rows hold NaN, so any read of
# them would show in the output:

import torch
import torch.nn.functional as F
from ragged_toolkit.attention import ragged_attention

lengths = torch.tensor([3, 1, 4])  # keys each sequence has cached
B, capacity, H, H_kv, D = 3, 6, 4, 2, 8
row_offsets = torch.arange(B + 1) * capacity  # [0, 6, 12, 18]
gen = torch.Generator().manual_seed(0)
k = torch.randn(B * capacity, H_kv, D, generator=gen)  # the cache, as packed rows
v = torch.randn(B * capacity, H_kv, D, generator=gen)
spare = (torch.arange(capacity) >= lengths[:, None]).flatten()  # rows not written yet
k[spare], v[spare] = float("nan"), float("nan")
q = torch.randn(B, H, D, generator=gen)  # one new query per sequence
one_each = torch.arange(B + 1)  # query offsets: [0, 1, 2, 3]
out = ragged_attention(q, k, v, one_each, row_offsets, is_causal=True, kv_used=lengths,
                       backend="loop")
assert out.isfinite().all(), "a spare row was read"
for b, n in enumerate(lengths.tolist()):  # the same, one sequence at a time
    kb, vb = (t[b * capacity:b * capacity + n].repeat_interleave(H // H_kv, 1)
              .transpose(0, 1) for t in (k, v))  # (H, n, D): the rows in use
    expected = F.scaled_dot_product_attention(q[b][:, None], kb, vb)[:, 0]  # (H, D)
    torch.testing.assert_close(out[b], expected)
print(f"row offsets {row_offsets.tolist()}, kv_used {lengths.tolist()}: "
      f"{int(spare.sum())} spare rows never read")

# %%
# The same cache drawn row by row: the rows in use, the spare ones, and the
# row each sequence's next token will write (its ``kv_used``, before it
# grows by one).

import matplotlib.pyplot as plt
from ragged_toolkit.figures import FIGURE_STYLE, draw_kv_cache

plt.rcParams.update(FIGURE_STYLE)
draw_kv_cache(lengths, capacity, new=lengths)
plt.show()

# %%
# The toolkit's ``KVCache`` holds such rows for every layer of a model, and
# writes new keys into them (``write_rows``; ``write_columns`` is for a
# padded batch):
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: KVCache
#
# Sizes
# ~~~~~
# Every size is set here, per device; :term:`quick mode` shrinks them. The
# model is small and randomly initialized: the point is the mechanics of
# decoding and their correctness, not the text. (For scale, Llama-2-70B has
# 8 key/value heads for 64 query heads, width 8192 and 80 layers.)

import numpy as np
from ragged_toolkit.device import default_device, default_dtype, quick_mode, quiet_known_notes
from ragged_toolkit.measuring.timing import TIMING_THREADS

DEVICE = default_device()
DTYPE = default_dtype(DEVICE)
# One CPU thread for the whole page, as every timing and profile uses
# (TIMING_THREADS): torch.compile guards on the thread count, so compiled
# code is then compiled once, for the threads it is timed with.
torch.set_num_threads(TIMING_THREADS)
QUICK = quick_mode()
SEED = 0
if DEVICE == "cuda":
    MODEL = dict(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                 ffn_hidden=2816, max_seq_len=4096)
    PROMPTS, ZIPF_ALPHA, NEW_TOKENS, GEN_LENGTHS = 64, 1.1, 64, (16, 64)
    RUN_TIME = 1.0
else:  # real serving: width 4096 and up, 32+ layers, 64-256 sequences
    MODEL = dict(vocab_size=512, dim=128, n_layers=4, n_heads=8, n_kv_heads=2,
                 ffn_hidden=352, max_seq_len=1024)
    PROMPTS, ZIPF_ALPHA, NEW_TOKENS, GEN_LENGTHS = 16, 1.2, 32, (8, 32)
    RUN_TIME = 0.25
if QUICK:
    MODEL.update(dim=64, n_layers=2, ffn_hidden=176, vocab_size=256)
    PROMPTS, NEW_TOKENS, GEN_LENGTHS, RUN_TIME = 6, 8, (4, 8), 0.1
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}, quick: {QUICK}")
print("model: " + ", ".join(f"{k} {v}" for k, v in list(MODEL.items())[:4]))
print("       " + ", ".join(f"{k} {v}" for k, v in list(MODEL.items())[4:]))
print(f"{PROMPTS} prompts, {NEW_TOKENS} new tokens each")

# sphinx_gallery_start_ignore
quiet_known_notes()
# sphinx_gallery_end_ignore

# %%
# A batch of prompts, two models
# ------------------------------
# Prompt lengths come from the site's length generator: most prompts are
# short, a few are long. The model is the GPT of :doc:`packed_gpt_training`
# (RMSNorm, rotary positions, SwiGLU), whose attention takes a *layout*:
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: GPT
#
# Two of them share everything but the number of key/value heads:
# multi-head attention (MHA, one key/value head per query head) and GQA
# (``n_heads / n_kv_heads`` query heads share each key/value head).

from ragged_toolkit.batches import offsets_from_lengths, sentence_lengths
from ragged_toolkit.gpt import GPT, GPTConfig

rng = np.random.default_rng(SEED)
prompt_lengths = sentence_lengths(rng, PROMPTS, ZIPF_ALPHA).clamp(
    max=MODEL["max_seq_len"] - NEW_TOKENS)
prompt_offsets = offsets_from_lengths(prompt_lengths, DEVICE)
gen = torch.Generator(DEVICE).manual_seed(SEED)
prompts = torch.randint(MODEL["vocab_size"], (int(prompt_lengths.sum()),), generator=gen,
                        device=DEVICE)
print(f"prompt lengths {prompt_lengths.tolist()}")
print(f"{len(prompts)} prompt tokens, longest {int(prompt_lengths.max())}; "
      f"padding to the longest would hold {PROMPTS * int(prompt_lengths.max())}")

gqa_cfg = GPTConfig(**MODEL)
mha_cfg = GPTConfig(**dict(MODEL, n_kv_heads=MODEL["n_heads"]))
torch.manual_seed(SEED)
gqa_model = GPT(gqa_cfg).to(DEVICE).eval()
torch.manual_seed(SEED)
mha_model = GPT(mha_cfg).to(DEVICE).eval()
if DTYPE != torch.float32:  # serving runs the weights in the low precision too
    gqa_model, mha_model = gqa_model.to(DTYPE), mha_model.to(DTYPE)
print(f"MHA: {mha_cfg.n_heads} query heads, {mha_cfg.n_kv_heads} key/value heads; "
      f"GQA: {gqa_cfg.n_heads} query heads, {gqa_cfg.n_kv_heads} key/value heads")

# %%
# The KV cache, step by step
# --------------------------
# The ``Packed`` layout writes each new token's key and value into its row of
# the cache, then attends over the cache's rows with ``kv_used``:
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: Packed
#
# ``generate_packed`` uses it twice:
#
# * **prefill**: all prompt tokens, packed, go through the model at once;
#   each writes its key and value into its sequence's row
#   ``b * capacity + p`` and attends causally to its own prompt;
# * **decode**: one token per sequence, at that sequence's own position
#   ``lengths[b]``, written into its next row; its query sees every key its
#   sequence has.
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: generate_packed
#
# The loop below is ``generate_packed`` unrolled, with a check at every step:
# the cached logits must equal a recomputation of the whole history without
# any cache, for every sequence. Both use the per-sequence loop backend, so
# that this check is about the cache's bookkeeping; every backend's kernel is
# checked against the float32 reference in the tables below.

from ragged_toolkit.batches import token_index
from ragged_toolkit.device import tolerances
from ragged_toolkit.layouts import PackedLayout
from ragged_toolkit.kv_cache import KVCache

torch.manual_seed(SEED)
history = [prompts[int(a):int(b)].tolist()
           for a, b in zip(prompt_offsets[:-1], prompt_offsets[1:])]
cache = KVCache(gqa_cfg, PROMPTS, int(prompt_lengths.max()) + NEW_TOKENS, DEVICE, DTYPE)
lengths = prompt_lengths.to(DEVICE)
seq, pos = token_index(prompt_offsets)
one_each = torch.arange(PROMPTS + 1, device=DEVICE)
worst = 0.0
with torch.no_grad():
    prefill = PackedLayout(prompt_offsets, "loop", cache, seq * cache.capacity + pos, lengths)
    logits = gqa_model(prompts, pos, prefill)[prompt_offsets[1:] - 1]
    for step in range(NEW_TOKENS):
        token = logits.argmax(-1)  # (B,)
        for h, t in zip(history, token.tolist()):
            h.append(t)
        # the same step without a cache: the whole packed history, recomputed
        offsets_h = offsets_from_lengths([len(h) for h in history], DEVICE)
        tokens_h = torch.tensor([t for h in history for t in h], device=DEVICE)
        full = gqa_model(tokens_h, token_index(offsets_h)[1], PackedLayout(offsets_h, "loop"))
        full = full[offsets_h[1:] - 1].float()
        # the cached step: one token per sequence at its own position
        step_layout = PackedLayout(one_each, "loop", cache, cache.row_offsets[:-1] + lengths,
                             lengths + 1)  # each token's row, and the keys now in use
        logits = gqa_model(token, lengths, step_layout)
        lengths = lengths + 1
        torch.testing.assert_close(logits.float(), full, **tolerances(DTYPE))
        worst = max(worst, (logits.float() - full).abs().max().item())
print(f"{NEW_TOKENS} steps x {PROMPTS} sequences: every cached step matches the "
      f"recomputation\n(largest logit difference {worst:.1e})")

# %%
# What the cache buys
# ~~~~~~~~~~~~~~~~~~~
# Without a cache, step ``t`` runs the whole history again: every prompt
# token plus ``t`` generated tokens per sequence. With it, each step runs one
# token per sequence. The :term:`work bound` counts the tokens each side
# pushes through the model (the projections and feed-forward layers, most of
# the arithmetic) and the query-key pairs its attention scores; here it is
# the work of the recomputation over the work of the cached generation.

from ragged_toolkit.measuring.bound import pairs_scored, speedup_line
from ragged_toolkit.decoding import generate_packed, teacher_forced_logits
from ragged_toolkit.measuring.timing import measure
from ragged_toolkit.measuring.noise import outside_noise


@torch.no_grad()
def generate_no_cache(model, prompts, offsets, n_new, backend=None):
    """Greedy generation that recomputes the whole packed history at every step."""
    lengths = offsets.diff()
    tokens = prompts
    out = []
    for step in range(n_new):
        seq, pos = token_index(offsets)
        logits = model(tokens, pos, PackedLayout(offsets, backend))[offsets[1:] - 1]
        out.append(logits.argmax(-1))
        # insert each sequence's new token at its end: rebuild the packed ids
        lengths = lengths + 1
        new_offsets = offsets_from_lengths(lengths, tokens.device)
        grown = torch.empty(len(tokens) + len(lengths), dtype=tokens.dtype,
                            device=tokens.device)
        grown[new_offsets[1:] - 1] = out[-1]
        keep = torch.ones(len(grown), dtype=torch.bool, device=tokens.device)
        keep[new_offsets[1:] - 1] = False
        grown[keep] = tokens
        tokens, offsets = grown, new_offsets
    return torch.stack(out, 1)


def generate(model, n_new, cached, backend="loop"):
    fn = generate_packed if cached else generate_no_cache
    return fn(model, prompts, prompt_offsets, n_new, backend)


per_token = 2 * sum(p.numel() for n, p in gqa_model.named_parameters()
                    if "embeddings" not in n)
per_pair = gqa_cfg.n_layers * 4 * gqa_cfg.n_heads * gqa_cfg.head_dim
# The cached generation's logits, step by step, against the same tokens fed
# to the model with no cache (teacher forcing): equal within the tolerance of
# the dtype, however rounding breaks a near tie; in float32, the same tokens.
written, chose = generate_packed(gqa_model, prompts, prompt_offsets, 8, "loop", return_logits=True)
forced = teacher_forced_logits(gqa_model, prompts, prompt_offsets, written)
torch.testing.assert_close(chose.float(), forced, **tolerances(DTYPE))
if DTYPE == torch.float32:
    assert torch.equal(generate(gqa_model, 8, False), written), "with and without the cache, other tokens"
tol = tolerances(DTYPE)
print(f"8 cached steps: logits within atol {tol['atol']:g}, rtol {tol['rtol']:g} of the teacher-forced "
      "recomputation")
throughput = {"cache": [], "no cache": []}
for n_new in GEN_LENGTHS:
    times = measure({"no cache": lambda: generate(gqa_model, n_new, False),
                     "cache": lambda: generate(gqa_model, n_new, True)},
                    min_run_time=RUN_TIME, profile=False)
    P, steps = prompt_lengths, torch.arange(n_new)
    grown = P[:, None] + steps  # each sequence's length at each step, (B, n_new)
    work_cached = per_token * (float(P.sum()) + PROMPTS * (n_new - 1)) + per_pair * (
        pairs_scored(P, P, True) + float((grown[:, 1:] + 1).sum()))
    work_recomputed = (per_token * float(grown.sum())
                       + per_pair * pairs_scored(grown.flatten(), grown.flatten(), True))
    for name in throughput:
        throughput[name].append(PROMPTS * n_new / times[name].median_ms * 1e3)
    print(speedup_line(f"KV cache, {n_new:3d} new tokens", times["no cache"],
                       times["cache"], work_recomputed / work_cached))

# %%
# The work bound grows with the output, since the recomputation redoes the
# whole history at every step. The :term:`fraction of the bound` says how
# much of it this device turned into speed. Below 1, fixed costs weigh on
# the cached steps: each runs only one token per sequence through the
# model, small matrix multiplies and one attention call per sequence and
# layer, where the recomputation makes a few big calls. A fraction above 1
# means the recomputation is slower per unit of work than the cached steps,
# for costs the bound, which counts FLOPs only, does not see (its growing
# tensors are allocated and copied at every step).

fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
x = np.arange(len(GEN_LENGTHS))
ax.bar(x - 0.2, throughput["cache"], 0.4, label="KV cache")
ax.bar(x + 0.2, throughput["no cache"], 0.4, label="recomputed every step", hatch="//")
ax.set_xticks(x, [str(n) for n in GEN_LENGTHS])
ax.set(xlabel="new tokens per sequence", ylabel="new tokens/s (median)",
       title=f"Greedy decoding, {PROMPTS} prompts, {DEVICE}")
fig.legend(loc="outside lower center", ncol=2)
plt.show()

# sphinx_gallery_thumbnail_number = 2

# %%
# A cached step runs one token per sequence through every layer: many small
# operators, each with a fixed cost (Python, dispatch, bookkeeping), for
# little arithmetic; :doc:`measuring_ragged_batches` shows how to profile a
# step to see it. The work bound counts FLOPs only, so the cached side
# reaches less of it the more its steps are bound by operator count.
#
# Cutting the step's overhead
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The step above rebuilds its bookkeeping every time: new offsets, new rows,
# and for the ``loop`` backend one attention call per sequence. A decoding
# batch is a rectangle (one token per sequence, a cache with the same room
# for each), so the step can have fixed shapes instead, as in gpt-fast:
# ``CachedStep`` writes each sequence's new keys at its slot, a tensor, and
# one SDPA call scores every slot of the cache, masked where not in use. Its
# shapes never change, so ``torch.compile(dynamic=False)`` compiles it once
# for the whole generation. It scores every slot, those not yet in use too:
# more arithmetic than the bound counts, for no per-step bookkeeping. The
# same rule as everywhere chooses eager or compiled (within the noise: eager).
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: CachedStep

from ragged_toolkit.decoding import call_model
from ragged_toolkit.measuring.noise import choose
from ragged_toolkit.measuring.compiling import compile_counter
from ragged_toolkit.measuring.tables import print_timings

compiled_step = torch.compile(call_model, dynamic=False)
lengths_dev = prompt_lengths.to(DEVICE)
n_new = GEN_LENGTHS[-1]


@torch.no_grad()
def generate_fixed(step=None, return_logits=False):
    """Packed prefill, then ``n_new - 1`` fixed-shape steps."""
    return generate_packed(gqa_model, prompts, prompt_offsets, n_new, "loop", fixed_shape=True, step=step,
                           return_logits=return_logits)


with compile_counter() as compiled:
    for name, step_fn in (("eager", None), ("compiled", compiled_step)):
        written, chose = generate_fixed(step_fn, return_logits=True)
        forced = teacher_forced_logits(gqa_model, prompts, prompt_offsets, written)
        torch.testing.assert_close(chose.float(), forced, **tolerances(DTYPE),
                                   msg=lambda m, name=name: f"the fixed-shape step ({name}): {m}")
print("fixed-shape steps, eager and compiled: logits within the tolerance of the teacher-forced "
      f"recomputation;\ncompiled: {compiled.graphs} graph(s) for {n_new - 1} steps, {compiled.breaks} graph breaks")
no_cache = times["no cache"]  # the last length above: n_new tokens
times = measure({
    "cache, packed step": lambda: generate(gqa_model, n_new, True),
    "cache, fixed-shape step": generate_fixed,
    "cache, fixed-shape step, compiled": lambda: generate_fixed(compiled_step),
}, min_run_time=2 * RUN_TIME, profile=False)
print_timings(times)
fixed = choose({"eager": times["cache, fixed-shape step"],
                "compiled": times["cache, fixed-shape step, compiled"]}, "eager",
               "fixed-shape step")
best = times["cache, fixed-shape step" + (", compiled" if fixed == "compiled" else "")]
bound = work_recomputed / work_cached
print(speedup_line(f"KV cache, {n_new:3d} new tokens, packed step", no_cache, times["cache, packed step"],
                   bound))
print(speedup_line(f"KV cache, {n_new:3d} new tokens, fixed-shape step", no_cache, best, bound))

# %%
# Cache memory: allocated and used
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The cache holds ``2 x layers x B x capacity x H_kv x D`` numbers; the
# figures below are computed from the shapes of its buffers, not measured.
# Of its ``B x capacity`` token slots, ``sum(lengths)`` hold data: few right
# after the prefill, more at each step. A cache that gives each sequence
# only the room it can use, ``prompt + new tokens``, would allocate
# ``sum(prompt + new)`` slots, the *exact room*; a paged cache comes close
# without knowing the lengths in advance (:doc:`serving_continuous_batching`).

import math


def cache_bytes(cfg):
    """Bytes allocated, bytes in use after each step (prefill first), exact room."""
    capacity = int(prompt_lengths.max()) + NEW_TOKENS
    c = KVCache(cfg, PROMPTS, capacity, DEVICE, DTYPE)
    allocated = c.k.nbytes + c.v.nbytes
    per_slot = allocated / (PROMPTS * capacity)  # per token, all layers, k and v
    used = per_slot * (float(prompt_lengths.sum()) + PROMPTS * np.arange(NEW_TOKENS + 1))
    return allocated, used, per_slot * float((prompt_lengths + NEW_TOKENS).sum())


memory = {"MHA": cache_bytes(mha_cfg), "GQA": cache_bytes(gqa_cfg)}
print(f"{'MiB, from shapes':16s} {'allocated':>10s} {'after prefill':>14s} "
      f"{'at the end':>14s} {'exact room':>11s}")
for name, (allocated, used, exact) in memory.items():
    prefill, end = (f"{b / 2**20:.2f} ({b / allocated:.0%})" for b in (used[0], used[-1]))
    print(f"{name:16s} {allocated / 2**20:10.2f} {prefill:>14s} {end:>14s} "
          f"{exact / 2**20:11.2f}")
ratio = memory["MHA"][0] / memory["GQA"][0]
assert math.isclose(ratio, gqa_cfg.n_heads / gqa_cfg.n_kv_heads)
print(f"MHA / GQA cache: {ratio:.1f}x "
      f"(n_heads / n_kv_heads = {gqa_cfg.n_heads // gqa_cfg.n_kv_heads})")

# %%
# Decoding attention: measure, then choose
# ----------------------------------------
# One decoding step of attention for the GQA model: one query per sequence
# against that sequence's cached keys, in the middle of generation. Every
# candidate is checked against the float32 reference (which repeats the
# key/value heads explicitly, sharing no GQA code with them) and timed. Each
# row: median and interquartile range (IQR) in ms, peak memory in MiB, and
# in brackets the :term:`kernel label` of what ran: whether a call read the
# small cache directly or repeated its heads first shows up there. On a CPU,
# ``CPU flash`` is SDPA's fused kernel and ``compiled graph (inductor
# kernel)`` the code ``torch.compile`` generated for FlexAttention.

import textwrap

from ragged_toolkit.attention import default_backend
from ragged_toolkit.measuring.compare import compare_backends
from ragged_toolkit.measuring.timing import Timing

capacity = int(prompt_lengths.max()) + NEW_TOKENS
used = (prompt_lengths + NEW_TOKENS // 2).to(DEVICE)
row_offsets = torch.arange(PROMPTS + 1, device=DEVICE) * capacity
q_step = torch.randn(PROMPTS, gqa_cfg.n_heads, gqa_cfg.head_dim, generator=gen,
                     device=DEVICE).to(DTYPE)
k_cache = torch.randn(PROMPTS * capacity, gqa_cfg.n_kv_heads, gqa_cfg.head_dim,
                      generator=gen, device=DEVICE).to(DTYPE)
v_cache = torch.randn_like(k_cache)
print(f"GQA, {PROMPTS} queries against {int(used.sum())} cached keys in use:")
with compile_counter() as flex_compiled:  # what the flex backend compiles
    decode_results = compare_backends(q_step, k_cache, v_cache, one_each, row_offsets,
                                      is_causal=True, kv_used=used, min_run_time=RUN_TIME)
print(f"torch.compile, the flex backend: {flex_compiled}")

# %%
# That table times one step's attention with its per-batch bookkeeping
# already done. While generating, the lengths change at every step, so
# whatever a backend prepares per batch (gather indices, a block mask) is
# prepared again at every step; the choice is made on whole generations,
# for the two backends with the fastest steps above and the default,
# ``default_backend``, by the rule of :doc:`measuring_ragged_batches`.

DEFAULT = default_backend(DEVICE, DTYPE)
ran = sorted((n for n, r in decode_results.items() if isinstance(r, Timing)),
             key=lambda n: decode_results[n].median_ms)[:2]
ran += [DEFAULT] if DEFAULT not in ran else []
with compile_counter() as generation_compiled:
    generation_times = measure(
        {name: lambda name=name: generate(gqa_model, NEW_TOKENS, True, name)
         for name in ran}, min_run_time=RUN_TIME / 2, rounds=6, profile=False)
print(f"whole generations of {NEW_TOKENS} tokens:")
print_timings(generation_times)
DECODE_BACKEND = choose(generation_times, DEFAULT, f"decoding backend on {DEVICE}")
if "flex" in ran:
    print(f"torch.compile, generations with flex: {generation_compiled}")

# %%
# FlexAttention without rebuilding the mask
# -----------------------------------------
# The ``flex`` backend builds a ``BlockMask`` for each batch it sees, and
# while decoding the lengths change at every step. ``create_block_mask``
# evaluates the mask over the whole grid, a cost added to every step's
# attention. The inference examples of FlexAttention build the mask once,
# for the cache's capacity, and then only refresh it. Here the mask function
# reads the current lengths from a tensor the loop updates in place, every
# listed block is *partial* (so the mask function runs inside the kernel),
# and each step only recomputes how many key blocks each sequence has,
# ``ceil(length / 128)``. Both ways are checked against the reference and
# timed per decoding step, for the GQA cache laid out as
# ``(B, H_kv, capacity, D)``.

from ragged_toolkit.attention.flex import compiled_flex_attention
from ragged_toolkit.attention.reference import reference_attention
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

BLOCK = 128
current = used.clone()  # the lengths the mask reads, updated in place


def within_length(b, h, q_idx, kv_idx):
    return kv_idx < current[b]


n_blocks = (capacity + BLOCK - 1) // BLOCK
kv_num_blocks = torch.zeros(PROMPTS, 1, 1, dtype=torch.int32, device=DEVICE)
kv_indices = torch.arange(n_blocks, dtype=torch.int32, device=DEVICE)
kv_indices = kv_indices.expand(PROMPTS, 1, 1, n_blocks).contiguous()
refreshed_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=BLOCK,
                                          mask_mod=within_length,
                                          seq_lengths=(1, capacity))


def refresh(lengths):
    current.copy_(lengths)
    kv_num_blocks.copy_(((lengths + BLOCK - 1) // BLOCK).view(-1, 1, 1))


q_dense = q_step[:, :, None]  # (B, H, 1, D)
k_dense, v_dense = (t.view(PROMPTS, capacity, *t.shape[1:]).transpose(1, 2)
                    for t in (k_cache, v_cache))  # (B, H_kv, capacity, D)


def flex_rebuilt():
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < used[b], PROMPTS, None,
                             1, capacity, device=DEVICE)
    return compiled_flex_attention(q_dense, k_dense, v_dense, block_mask=mask,
                                   enable_gqa=True)


def flex_refreshed():
    refresh(used)
    return compiled_flex_attention(q_dense, k_dense, v_dense, block_mask=refreshed_mask,
                                   enable_gqa=True)


reference_step = reference_attention(q_step, k_cache, v_cache, one_each, row_offsets,
                                     is_causal=True, kv_used=used)
with torch.no_grad(), compile_counter() as step_compiled:
    for fn in (flex_rebuilt, flex_refreshed):
        torch.testing.assert_close(fn()[:, :, 0].float(), reference_step,
                                   **tolerances(DTYPE))
    step_compiled.saw(tuple(q_dense.shape))
    flex_times = measure({"mask rebuilt": flex_rebuilt, "mask refreshed": flex_refreshed},
                         min_run_time=RUN_TIME)
print("FlexAttention, one decoding step:")
print_timings(flex_times)
print(f"torch.compile: {step_compiled}")
rebuilt, refreshed = flex_times["mask rebuilt"], flex_times["mask refreshed"]
print(f"time per step, mask rebuilt / mask refreshed: "
      f"{rebuilt.median_ms / refreshed.median_ms:.2f}x")

# %%
# Grouped-query attention, end to end
# -----------------------------------
# The promise of GQA is a smaller cache, which is what bounds batch size and
# context length in serving, and less memory to read at every step. Both
# models generate with the decoding backend chosen above; the kernels that
# ran are printed beside each time. The two take turns, round by round, so
# that their spreads can be compared.

gqa_times = measure(
    {name: lambda model=model: generate(model, NEW_TOKENS, True, DECODE_BACKEND)
     for name, model in (("MHA", mha_model), ("GQA", gqa_model))},
    min_run_time=RUN_TIME, rounds=6)
for name, t in gqa_times.items():
    throughput[name] = PROMPTS * NEW_TOKENS / t.median_ms * 1e3
print_timings(gqa_times)
print(f"new tokens/s: MHA {throughput['MHA']:,.0f}, GQA {throughput['GQA']:,.0f}")
print(f"GQA / MHA decoding throughput: {throughput['GQA'] / throughput['MHA']:.2f}x; "
      f"cache {ratio:.1f}x smaller")
if outside_noise(gqa_times["GQA"], gqa_times["MHA"]):
    word = "faster" if throughput["GQA"] > throughput["MHA"] else "slower"
    print(f"GQA decodes {word} than MHA here, outside the noise (the IQRs do not overlap)")
else:
    print("GQA against MHA, time per generation: within noise (the IQRs overlap)")

# %%
# Nested tensors do not take the GQA route: SDPA on nested inputs cannot
# share key/value heads, and ``backend_support`` says so, which is why the
# ``sdpa_njt`` rows above are missing for GQA.
#
# varlen attention
# ----------------
# ``torch.nn.attention.varlen.varlen_attn`` is the variable-length kernel of
# FlashAttention: packed ``(T, H, D)`` queries, keys and values, the
# offsets as ``int32`` ``cu_seq_q`` and ``cu_seq_k``, and the longest lengths.
# Its keyword arguments changed between releases, so the toolkit reads them
# from the signature: causal is ``is_causal=True`` in 2.10 and
# ``window_size=(-1, 0)`` later; ``enable_gqa`` (without it, the toolkit
# repeats the key/value heads) and ``seqused_k`` (without it, the toolkit
# gathers the rows in use) arrived after 2.11. What this build has:

import inspect

from ragged_toolkit.attention import backend_support
from ragged_toolkit.attention.varlen import varlen_attn, varlen_keywords

keywords = varlen_keywords()  # empty where this PyTorch has no varlen_attn
if varlen_attn is not None:
    print(textwrap.fill(f"varlen_attn({', '.join(inspect.signature(varlen_attn).parameters)})", 90,
                        subsequent_indent="    "))
for what, keyword, instead in (("causal through", "window_size", "is_causal=True"),
                               ("grouped-query attention", "enable_gqa", "the toolkit repeats the heads"),
                               ("keys in use per sequence", "seqused_k", "the toolkit gathers the rows in use")):
    print(f"{what}: {keyword if keyword in keywords else 'not in this release: ' + instead}")
why = backend_support("varlen", DEVICE, DTYPE, is_causal=True, gqa=True)
print(textwrap.fill(f"varlen_attn on this device: {why or 'runs'}; the decoding backend "
                    f"chosen here: {DECODE_BACKEND}", 90, subsequent_indent="  "))

# %%
# Conclusion
# ----------
# The original building-blocks tutorial left three sections pending in 2024,
# all on nested tensors: key/value caching, GQA and FlexAttention. PyTorch
# has since pointed ragged attention at packed sequences, and on packed
# values and offsets all three work today:
#
# * **A KV cache** for a ragged batch is a buffer with room per sequence and
#   a count of the rows each sequence uses; ``ragged_attention``'s
#   ``kv_used`` (``seqused_k`` in ``varlen_attn``) tells each sequence's
#   rows in use; the ``loop``, ``padded`` and ``flex`` backends, and
#   ``varlen_attn`` where it has ``seqused_k``, read them in place, the others
#   gather them first. Every cached step matched a full recomputation.
# * **GQA** shrinks the cache by ``n_heads / n_kv_heads``; whether a step
#   also reads less memory depends on the kernel, which the tables above
#   name for this device.
# * **FlexAttention** decodes from the same cache with a mask built once and
#   refreshed per step, and **varlen_attn** takes the same offsets on CUDA.
#
# References
# ----------
# * ``varlen_attn``: https://docs.pytorch.org/docs/stable/nn.attention.varlen.html
# * FlexAttention for inference: https://pytorch.org/blog/flexattention-for-inference/
# * ``gpt-fast``: https://github.com/meta-pytorch/gpt-fast
# * Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models
#   from Multi-Head Checkpoints", 2023: https://arxiv.org/abs/2305.13245
