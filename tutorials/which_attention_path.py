"""
Which attention path should I use?
==================================

Every padding-free attention path PyTorch offers, against every job a reader
has, on the device that built this page: whether it runs and why not,
whether it is correct, how fast, how much memory, and which kernel actually
ran. Then a decision guide drawn from this build's table.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Which of padding with a mask, SDPA on nested tensors, FlexAttention
         with a document mask, ``varlen_attn``, a per-sequence loop and length
         buckets can serve inference, training, decoding against a cache, a
         custom score function and grouped-query attention on your device
       * How to read the kernel that ran, and why the answer changes between
         a CPU and a GPU

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * The toolkit of the building-blocks page (copied below, so this file
         runs on its own)
       * PyTorch 2.11 or later; on a CPU the table shows the CPU, on a CUDA
         GPU it runs at full scale in ``bfloat16``

The answer to "which attention path?" is a measurement, not a rule: it
depends on the device, the dtype, the lengths and the job. This page runs
the measurement; everything it concludes is printed from the table below, so
it holds for the device named at the top of the page and nowhere else.
"""

# sphinx_gallery_tags = ["decision guide", "SDPA", "FlexAttention", "varlen attention", "benchmarks"]

# %%
# Setup
# -----

import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


from ragged_toolkit import (
    BACKENDS, Timing, compare_backends, default_device, default_dtype, fastest, from_padded,
    measure, offsets_from_lengths, quick_mode, quiet_known_notes, ragged_attention,
    reference_attention, sentence_lengths, speedup_line, to_padded, token_index, tolerances,
    where_time_goes, work_bound,
)

DEVICE = default_device()
DTYPE = default_dtype(DEVICE)
QUICK = quick_mode()
SEED = 0
torch.manual_seed(SEED)
print(f"PyTorch {torch.__version__}, device: {DEVICE}"
      + (f" ({torch.cuda.get_device_name()})" if DEVICE == "cuda" else f", {os.cpu_count()} cores")
      + f", dtype: {DTYPE}")

# sphinx_gallery_start_ignore
quiet_known_notes()
# sphinx_gallery_end_ignore

# %%
# Sizes
# ~~~~~
# One batch of sentences from the site's length generator, with attention of
# ``HEADS`` heads of size ``HEAD_DIM``; the grouped-query job shares each
# key/value head among four query heads.

if DEVICE == "cuda":
    BATCH, HEADS, HEAD_DIM, ZIPF_ALPHA, RUN_TIME = 256, 16, 64, 1.1, 0.5
else:
    BATCH, HEADS, HEAD_DIM, ZIPF_ALPHA, RUN_TIME = 48, 8, 32, 1.2, 0.2
if QUICK:
    BATCH, RUN_TIME = 12, 0.05
KV_HEADS = HEADS // 4  # for the grouped-query job
print(f"batch {BATCH}, {HEADS} heads of {HEAD_DIM}, GQA with {KV_HEADS} key/value heads")

# %%
# The jobs
# --------
# Five things a reader asks attention to do, all on the same ragged batch:
#
# * **inference**: causal self-attention, forward only;
# * **training**: the same, forward and backward;
# * **decoding**: one new query per sequence against that sequence's keys in
#   a KV cache with spare room (``kv_used``), as in every generation step; a
#   single query sees every key in use, so it needs no causal mask;
# * **GQA**: inference with four query heads per key/value head;
# * **score_mod**: inference with a custom score function, here the
#   distance penalty of ALiBi (the next cell).
#
# The first four go through ``compare_backends``; each row of the table is a
# backend, each column a job.

rng = np.random.default_rng(SEED)
lengths = sentence_lengths(rng, BATCH, ZIPF_ALPHA)
offsets = offsets_from_lengths(lengths, DEVICE)
T = int(lengths.sum())
gen = torch.Generator(DEVICE).manual_seed(SEED)


def randn(*shape):
    return torch.randn(*shape, generator=gen, device=DEVICE).to(DTYPE)


q, k, v = randn(T, HEADS, HEAD_DIM), randn(T, HEADS, HEAD_DIM), randn(T, HEADS, HEAD_DIM)
capacity = int(lengths.max()) + 32
one_each = torch.arange(BATCH + 1, device=DEVICE)
cache_offsets = one_each * capacity
k_cache, v_cache = randn(BATCH * capacity, HEADS, HEAD_DIM), randn(BATCH * capacity, HEADS, HEAD_DIM)
print(f"{BATCH} sequences, {T} tokens, longest {int(lengths.max())}; "
      f"padding would hold {BATCH * int(lengths.max())} slots")

table = {}
print("inference (causal, forward):")
table["inference"] = compare_backends(q, k, v, offsets, is_causal=True, min_run_time=RUN_TIME)
print("training (causal, forward and backward):")
table["training"] = compare_backends(q, k, v, offsets, is_causal=True, backward=True, min_run_time=RUN_TIME)
print("decoding (one query per sequence against its cache):")
q_one = randn(BATCH, HEADS, HEAD_DIM)  # one new query per sequence
table["decoding"] = compare_backends(q_one, k_cache, v_cache, one_each, cache_offsets,
                                     kv_used=lengths.to(DEVICE), min_run_time=RUN_TIME)
print(f"GQA ({HEADS} query heads, {KV_HEADS} key/value heads, causal, forward):")
table["GQA"] = compare_backends(q, k[:, :KV_HEADS].contiguous(), v[:, :KV_HEADS].contiguous(), offsets,
                                is_causal=True, min_run_time=RUN_TIME)

# %%
# The baseline: padded tensors
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The ``padded`` backend pads packed tensors inside the call, which costs it
# a gather and a scatter that a model written for padded batches never pays:
# its tensors are padded from the start. So the baseline of every job is
# attention on tensors that are already padded, ``(B, H, S, D)`` with right
# padding: one SDPA call with ``is_causal`` (a causal query never reaches a
# padding key), or with a key mask where queries see a cache. Each is checked
# against the same reference on the real tokens.

q_pad, valid = to_padded(q, offsets)  # (B, S, H, D), (B, S)
k_pad, v_pad = to_padded(k, offsets)[0], to_padded(v, offsets)[0]
qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q_pad, k_pad, v_pad))  # (B, H, S, D)
kh_gqa, vh_gqa = kh[:, :KV_HEADS].contiguous(), vh[:, :KV_HEADS].contiguous()
q_step = q_one
used = lengths.to(DEVICE)
k_dense = k_cache.view(BATCH, capacity, HEADS, HEAD_DIM)[:, :int(used.max())].transpose(1, 2).contiguous()
v_dense = v_cache.view(BATCH, capacity, HEADS, HEAD_DIM)[:, :int(used.max())].transpose(1, 2).contiguous()
key_in_use = (torch.arange(int(used.max()), device=DEVICE) < used[:, None])[:, None, None, :]  # (B, 1, 1, S)
# The gradient of a masked loss: zero at padding, so padding queries add
# nothing to the gradients of the real keys and values.
grad_packed = randn(T, HEADS, HEAD_DIM)
grad_h = to_padded(grad_packed, offsets)[0].transpose(1, 2).contiguous()
qh_train, kh_train, vh_train = (t.detach().requires_grad_() for t in (qh, kh, vh))


def baseline_inference():
    with torch.no_grad():
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)


def baseline_training():
    out = F.scaled_dot_product_attention(qh_train, kh_train, vh_train, is_causal=True)
    return torch.autograd.grad(out, (qh_train, kh_train, vh_train), grad_h)


def baseline_decoding():
    with torch.no_grad():
        return F.scaled_dot_product_attention(q_step[:, :, None], k_dense, v_dense, attn_mask=key_in_use)


def baseline_gqa():
    with torch.no_grad():
        return F.scaled_dot_product_attention(qh, kh_gqa, vh_gqa, is_causal=True, enable_gqa=True)


def unpad(out):  # (B, H, S, D) -> packed (T, H, D), float32 for the comparison
    return from_padded(out.transpose(1, 2), offsets).float()


tol = tolerances(DTYPE)
torch.testing.assert_close(unpad(baseline_inference()), reference_attention(q, k, v, offsets, is_causal=True), **tol)
torch.testing.assert_close(unpad(baseline_gqa()), reference_attention(q, k[:, :KV_HEADS], v[:, :KV_HEADS], offsets,
                                                                    is_causal=True), **tol)
torch.testing.assert_close(baseline_decoding()[:, :, 0].float(),
                           reference_attention(q_step, k_cache, v_cache, one_each, cache_offsets, kv_used=used), **tol)
q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
reference_grads = torch.autograd.grad(reference_attention(q32, k32, v32, offsets, is_causal=True), (q32, k32, v32),
                                      grad_packed.float())
for name, g, r in zip("qkv", baseline_training(), reference_grads):
    torch.testing.assert_close(unpad(g), r, **tol, msg=lambda m, name=name: f"padded tensors, d{name}: {m}")
baselines = measure({"inference": baseline_inference, "training": baseline_training, "decoding": baseline_decoding,
                     "GQA": baseline_gqa}, min_run_time=RUN_TIME)
for job, t in baselines.items():
    table[job]["padded tensors"] = t
    print(f"{job:10s} padded tensors {t}")

# %%
# A custom score function
# ~~~~~~~~~~~~~~~~~~~~~~~
# ``ragged_attention`` takes no score function: of the backends, only
# FlexAttention accepts arbitrary Python (``score_mod``) and compiles it into
# its kernel. A dense SDPA call can take a precomputed additive bias instead,
# which works for the per-sequence loop (one bias per sequence) and for
# padding (one bias for the padded square). ``varlen_attn`` and SDPA on
# nested tensors take neither. Each path that can is checked against the
# float32 reference with the bias built explicitly.

slopes = torch.exp2(-8.0 * torch.arange(1, HEADS + 1, device=DEVICE) / HEADS)  # (H,)
seq_id, position = token_index(offsets)


def alibi_penalty(score, b, h, q_idx, kv_idx):  # q_idx, kv_idx: packed positions
    return score - slopes[h] * (q_idx - kv_idx)


def causal_within_sequence(b, h, q_idx, kv_idx):
    return (seq_id[q_idx] == seq_id[kv_idx]) & (q_idx >= kv_idx)


@torch.compile(dynamic=False)
def flex_alibi(q, k, v, block_mask):
    return flex_attention(q, k, v, score_mod=alibi_penalty, block_mask=block_mask)


def alibi_bias(n):  # (H, n, n): the penalty, and -inf above the diagonal
    distance = (torch.arange(n, device=DEVICE)[:, None] - torch.arange(n, device=DEVICE)).float()
    return (-slopes[:, None, None] * distance).masked_fill(distance < 0, float("-inf"))


score_mask = create_block_mask(causal_within_sequence, None, None, T, T, device=DEVICE)
q_seqs, k_seqs, v_seqs = (t.split(lengths.tolist()) for t in (q, k, v))


def score_mod_flex():
    with torch.no_grad():
        return flex_alibi(*(t.transpose(0, 1)[None] for t in (q, k, v)), score_mask)[0].transpose(0, 1)


loop_biases = [alibi_bias(len(a)).to(DTYPE)[None] for a in q_seqs]  # built once per batch, as pad_bias below


def score_mod_loop():  # (1, H, L, D) per sequence: four dimensions, as the fused CPU kernel takes them
    with torch.no_grad():
        return torch.cat([F.scaled_dot_product_attention(
            a.transpose(0, 1)[None], b.transpose(0, 1)[None], c.transpose(0, 1)[None], attn_mask=bias
        )[0].transpose(0, 1) for a, b, c, bias in zip(q_seqs, k_seqs, v_seqs, loop_biases)])


pad_bias = alibi_bias(q_pad.shape[1]).masked_fill(~valid[:, None, None, :], float("-inf")).to(DTYPE)


def score_mod_padded():
    with torch.no_grad():
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=pad_bias)


with sdpa_kernel(SDPBackend.MATH):  # float32, and no kernel shared with the paths checked
    reference = torch.cat([F.scaled_dot_product_attention(
        a.float().transpose(0, 1), b.float().transpose(0, 1), c.float().transpose(0, 1), attn_mask=alibi_bias(len(a))
    ).transpose(0, 1) for a, b, c in zip(q_seqs, k_seqs, v_seqs)])
runs = {"flex": score_mod_flex, "loop": score_mod_loop, "padded tensors": score_mod_padded}
for name, fn in runs.items():
    out = unpad(fn()) if name == "padded tensors" else fn().float()
    torch.testing.assert_close(out, reference, **tolerances(DTYPE))
times = measure(runs, min_run_time=RUN_TIME)
table["score_mod"] = {
    "varlen": "no score function or bias argument",
    "sdpa_njt": "SDPA on nested tensors takes no mask or bias",
    "bucketed": "possible with a bias per bucket; not written here",
    "padded": "the padded tensors below take the bias; this backend takes none",
    **times,
}
print("score_mod (ALiBi, causal, forward):")
for name in BACKENDS + ("padded tensors",):
    r = table["score_mod"][name]
    print(f"  {name:9s} {r}" if isinstance(r, Timing) else f"  {name:9s} not available: {r}")

# %%
# The table
# ---------
# One row per path, one column per job: the median time in ms, the speedup
# over the padded tensors for the same job, and in brackets that speedup as
# a fraction of the job's work bound; "n/a" where the path cannot take the
# job here (the printouts above say why). Every number that appears passed
# its correctness check first. The last row is each job's work bound: the
# query-key pairs the padded baseline scores over the pairs the sequences
# need. Where the job is causal, both sides count the causal half (a causal
# kernel skips the rest), except for the score function: there the padded
# baseline and the per-sequence loop add a bias to the whole square and
# compute all of it, so both sides count the square (FlexAttention skips
# the masked blocks, and can pass that bound). For
# decoding, the padded side scores every cached row up to the longest
# sequence, the ragged side the rows in use.

ones = torch.ones(BATCH, dtype=torch.long)
BOUND = {job: work_bound(lengths, per_token=0.0, per_pair=1.0, causal=True)
         for job in ("inference", "training", "GQA")}
BOUND["score_mod"] = work_bound(lengths, per_token=0.0, per_pair=1.0, causal=False)
BOUND["decoding"] = work_bound(ones, lengths, per_token=0.0, per_pair=1.0)
JOBS = list(table)
ROWS = ("padded tensors",) + BACKENDS
# speedup[i, j]: row i over the padded tensors on job j; NaN where row i cannot take it
speedup = np.array([[table[job]["padded tensors"].median_ms / table[job][name].median_ms
                     if isinstance(table[job][name], Timing) else np.nan for job in JOBS] for name in ROWS])


def as_speedup(s):  # a speedup, with two decimals below 1x so that 0.04x does not read 0.0x
    return f"{s:.{1 if s >= 1 else 2}f}x"


width = 24
print(f"{'':10s}" + "".join(f"{job:>{width}s}" for job in JOBS))
for i, name in enumerate(ROWS):
    cells = []
    for j, job in enumerate(JOBS):
        if np.isnan(speedup[i, j]):
            cells.append("n/a")
        elif name == "padded tensors":
            cells.append(f"{table[job][name].median_ms:8.2f} ms")
        else:
            cells.append(f"{table[job][name].median_ms:8.2f} ms {as_speedup(speedup[i, j]):>5s} "
                         f"({speedup[i, j] / BOUND[job]:.2f})")
    print(f"{name:10s}" + "".join(f"{c:>{width}s}" for c in cells))
print(f"{'bound':10s}" + "".join(f"{BOUND[job]:>{width - 1}.1f}x" for job in JOBS))

# %%
# The same table as a figure: each cell is the speedup over the padded
# tensors for that job (higher is better) and, below it, the fraction of
# the job's work bound; "n/a" where the path cannot take the job here.

import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(8.5, 5))
image = ax.imshow(np.log2(speedup), cmap="RdYlGn", vmin=-3, vmax=3, aspect="auto")
for i in range(len(ROWS)):
    for j in range(len(JOBS)):
        text = "n/a" if np.isnan(speedup[i, j]) else as_speedup(speedup[i, j])
        if ROWS[i] != "padded tensors" and not np.isnan(speedup[i, j]):
            text += f"\n{speedup[i, j] / BOUND[JOBS[j]]:.2f} of bound"
        ax.text(j, i, text, ha="center", va="center", fontsize=8)
ax.set_xticks(range(len(JOBS)), JOBS)
ax.set_yticks(range(len(ROWS)), ROWS)
ax.set_title(f"Speedup over padding, {DEVICE}, {str(DTYPE).removeprefix('torch.')}")
fig.colorbar(image, ax=ax, label="log2 speedup")
fig.tight_layout()
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# The decision guide, from this build
# -----------------------------------
# For each job: the fastest path that ran correctly here, how it compares
# with padding, and what runs if your device cannot take it. The kernel
# named is the one the profiler saw.

for job in JOBS:
    ran = {n: r for n, r in table[job].items() if isinstance(r, Timing)}
    best = fastest(ran)
    others = sorted((n for n in ran if n != best), key=lambda n: ran[n].median_ms)
    missing = [n for n in ROWS if n not in ran]
    print(f"{job}: use {best} ({ran[best].median_ms:.2f} ms"
          + (f"; kernel: {ran[best].kernels}" if ran[best].kernels else "") + ")"
          + (f"; then {', '.join(others)}" if others else "")
          + (f"; not here: {', '.join(missing)}" if missing else ""))
    if best != "padded tensors":
        print("    " + speedup_line(f"{best} against padded tensors", ran["padded tensors"], ran[best], BOUND[job]))

# %%
# Where the time goes
# ~~~~~~~~~~~~~~~~~~~
# Attention alone has a large work bound for ragged batches, because padding
# costs it the square of the padded length. A path that does only the real
# work still pays per call, per sequence or per block, costs that the bound
# does not count, and the fractions above show how much of the bound each
# path kept on this device. The profiles of two jobs, inference and the
# score function, for the padded baseline and for the path chosen for each,
# show what each spent its time on.

best = fastest({n: r for n, r in table["inference"].items() if isinstance(r, Timing) and n in BACKENDS})
print("inference, padded tensors:")
print(where_time_goes(baseline_inference))
print(f"inference, the path chosen ({best}):")
with torch.no_grad():
    print(where_time_goes(lambda: ragged_attention(q, k, v, offsets, is_causal=True, backend=best)))
best = fastest({n: r for n, r in table["score_mod"].items() if isinstance(r, Timing) and n != "padded tensors"})
print("score_mod, padded tensors:")
print(where_time_goes(score_mod_padded))
print(f"score_mod, the path chosen ({best}):")
print(where_time_goes(runs[best]))

# %%
# How to read it. The ranking holds for this device, this dtype and these
# lengths: re-run the page (or ``compare_backends`` on your own batch) on the
# machine you will train or serve on. A few things hold everywhere, because
# they follow from what each path computes rather than from a measurement:
#
# * padding does the work of ``B x S_max`` tokens whatever the lengths, so
#   its cost grows with the longest sequence, not with the batch's tokens;
# * the per-sequence loop does exactly the real work but pays one call per
#   sequence, so it suits few long sequences better than many short ones;
# * FlexAttention is the only path here that takes an arbitrary score
#   function, and on CPU it has no backward (in PyTorch 2.11 to 2.15);
# * ``varlen_attn`` needs CUDA and a half-precision dtype, and reads a KV
#   cache with spare room directly (``seqused_k``) where its release has it.
#
# References
# ----------
# * ``scaled_dot_product_attention``: https://docs.pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html
# * FlexAttention: https://pytorch.org/blog/flexattention/
# * ``varlen_attn``: https://docs.pytorch.org/docs/stable/nn.attention.varlen.html
