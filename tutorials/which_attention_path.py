"""
Which attention path should I use?
==================================

Every padding-free attention path PyTorch offers, against every job a reader
has, on the device that built this page: whether it runs and why not,
whether it is correct, how fast, and which kernel ran; then a decision
guide built from those measurements.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Which of padding, SDPA on nested tensors, FlexAttention with a
         document mask, ``varlen_attn``, a per-sequence loop and length
         buckets can serve inference, training, decoding against a cache,
         grouped-query attention, a custom score function and a serving
         step on your device
       * How fast each is against the padded layout the job would otherwise
         run, beside the :term:`work bound`
       * What a decoding step pays for its bookkeeping, and how
         FlexAttention decodes without rebuilding its block mask
       * How to read which kernel ran (its :term:`kernel label`), and what
         this release's ``varlen_attn`` takes

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * The :doc:`building-blocks page <transformer_building_blocks>`:
         ``ragged_attention``, its six backends and ``compare_backends``
       * PyTorch 2.11 or later; on a CPU the tables show the CPU, on a CUDA
         GPU the page runs at full scale in ``bfloat16``
"""

# sphinx_gallery_tags = ["decision guide", "SDPA", "FlexAttention", "varlen attention", "benchmarks"]

# %%
# Six jobs, every path, one measurement
# -------------------------------------
# The answer to "which attention path?" is a measurement, not a rule: it
# depends on the device, the dtype, the lengths and the job. This page runs
# six jobs on one ragged batch:
#
# * **inference**: causal self-attention, forward only; **training**: the
#   same, forward and backward;
# * **decoding**: a generation step, its bookkeeping included: one new query
#   per sequence against the keys it has in a KV cache with spare room
#   (``kv_used``), which a single query sees all of (no causal mask);
# * **GQA**: inference with four query heads per key/value head;
# * **score_mod**: inference with a custom score function, the penalty of ALiBi;
# * **serving**: one step of continuous batching over a paged KV cache,
#   prompt chunks and decode tokens in one packed batch.
#
# Each job goes through the six backends of ``ragged_attention``, whose code
# the :doc:`building-blocks page <transformer_building_blocks>` shows, a
# function each (its section "Six backends, six ways to compute it"); through
# the baseline, the padded layout the job would otherwise run; and through
# the paths written below. Every number printed passed its correctness check
# first, and every conclusion is printed from the numbers, so it holds for
# the device named below. The sizes, per device (:term:`quick mode` shrinks
# them):

import os

import torch
from ragged_toolkit.device import page_setup

SIZES = {
    # a serving batch; blocks of 256 rows, as the paged kernel of FlashAttention needs
    "cuda": dict(batch=256, heads=16, head_dim=64, zipf_alpha=1.1, block=256, run_time=0.5),
    # 90 s on 2 cores; real batches are the CUDA size and larger
    "cpu": dict(batch=48, heads=8, head_dim=32, zipf_alpha=1.2, block=16, run_time=0.2),
    "quick": dict(batch=12, run_time=0.05),  # TUTORIALS_QUICK=1, on either device
}
setup = page_setup(SIZES)
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
KV_HEADS = S.heads // 4  # the GQA job: four query heads share each key/value head
where = torch.cuda.get_device_name() if DEVICE == "cuda" else f"{os.cpu_count()} cores"
print(f"{where}; batch {S.batch}, {S.heads} heads of {S.head_dim}, GQA with {KV_HEADS} key/value heads")

# %%
# The batch is drawn from the site's length generator. The first four jobs
# go through ``compare_backends``, which checks each backend against a
# float32 reference before timing it. The decoding job builds each
# backend's plan inside the timed call (``plan_per_call``): while
# generating, the lengths change at every step, so whatever a backend
# prepares per batch (gather indices, a block mask) is prepared again at
# every step. Each line ends with the :term:`kernel label` of what ran
# (``[CPU flash x12]``: SDPA's fused CPU kernel, twelve calls; quick mode
# profiles nothing, so it shows none).

import numpy as np
from ragged_toolkit.batches import offsets_from_lengths, sentence_lengths
from ragged_toolkit.measuring.compare import compare_backends

lengths = sentence_lengths(np.random.default_rng(setup.seed), S.batch, S.zipf_alpha)
offsets = offsets_from_lengths(lengths, DEVICE)
T = int(lengths.sum())
gen = torch.Generator(DEVICE).manual_seed(setup.seed)


def randn(*shape):
    return torch.randn(*shape, generator=gen, device=DEVICE).to(DTYPE)


q, k, v = (randn(T, S.heads, S.head_dim) for _ in range(3))  # (T, H, D)
k_gqa, v_gqa = k[:, :KV_HEADS].contiguous(), v[:, :KV_HEADS].contiguous()  # (T, H_kv, D)
capacity = int(lengths.max()) + 32  # a KV cache's room per sequence
one_each = torch.arange(S.batch + 1, device=DEVICE)  # query offsets: one query per sequence
cache_offsets = one_each * capacity
k_cache, v_cache = (randn(S.batch * capacity, S.heads, S.head_dim) for _ in range(2))
q_one = randn(S.batch, S.heads, S.head_dim)  # one new query per sequence
used = lengths.to(DEVICE)  # the keys each sequence has in its cache
print(f"{S.batch} sequences, {T} tokens, longest {int(lengths.max())}; "
      f"padding would hold {S.batch * int(lengths.max())} slots")

JOBS = {  # job -> the tensors and offsets compare_backends gets, and its keywords
    "inference": ((q, k, v, offsets), dict(is_causal=True)),
    "training": ((q, k, v, offsets), dict(is_causal=True, backward=True)),
    "decoding": ((q_one, k_cache, v_cache, one_each, cache_offsets), dict(kv_used=used, plan_per_call=True)),
    "GQA": ((q, k_gqa, v_gqa, offsets), dict(is_causal=True)),
}
table = {}  # job -> path -> its Timing, or why it cannot take the job here
for job, (tensors, keywords) in JOBS.items():
    print(f"{job}:")
    table[job] = compare_backends(*tensors, **keywords, min_run_time=S.run_time, profile=not setup.quick)

# %%
# varlen_attn in this release
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``varlen_attn`` is the variable-length kernel of FlashAttention: CUDA only, in
# ``float16`` or ``bfloat16`` (hence "not available" on a CPU). Its keyword
# arguments changed in every release from 2.10 to 2.12 (causal as
# ``is_causal``, then as ``window_size``; ``enable_gqa``, ``seqused_k`` and
# ``block_table`` later), so the toolkit adapts every call in one place, to
# the keywords of the installed release (``VARLEN_KEYWORDS``, read from its
# signature); a feature the release lacks raises ``VarlenUnavailable``,
# naming it, and is never dropped. What this release takes:
#
# .. literalinclude:: ../ragged_toolkit/attention/varlen.py
#    :pyobject: varlen_kwargs

from ragged_toolkit.attention import backend_support
from ragged_toolkit.attention.varlen import VARLEN_KEYWORDS, VarlenUnavailable, varlen_kwargs, varlen_missing

print(f"varlen_attn in PyTorch {torch.__version__}: "
      + (f"{len(VARLEN_KEYWORDS)} parameters" if VARLEN_KEYWORDS else "none in this build"))
WITHOUT = {  # what the toolkit does where the release lacks a feature
    "causal": "no causal job runs on varlen", "enable_gqa": "the backend repeats the key/value heads",
    "seqused_k": "the keys in use are gathered first", "block_table": "a paged cache is gathered first"}
for feature, instead in WITHOUT.items():
    print(f"  {feature:11s} {'no: ' + instead if varlen_missing([feature]) else 'yes'}")
try:  # a call that needs what 2.11's varlen_attn lacks
    varlen_kwargs(is_causal=True, enable_gqa=True, keywords={"return_aux", "scale", "window_size"})
except VarlenUnavailable as err:
    print(f"with the keywords of 2.11: {err}")
why_not = backend_support("varlen", DEVICE, DTYPE, is_causal=True, head_dim=S.head_dim)
print(f"varlen_attn on this device: {why_not or 'runs'}")

# %%
# Decoding without rebuilding the mask
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The ``flex`` row of the decoding job pays ``create_block_mask`` at every
# step: its plan evaluates the mask over the whole grid. FlexAttention's
# inference examples build the mask once, for the cache's capacity, and
# only refresh it: here the cache is read in place as ``(B, H, capacity,
# D)``, the mask function reads the lengths from a tensor each step updates
# in place, every listed block is *partial* (the mask function runs inside
# the kernel), and a step only recounts each sequence's key blocks.

from ragged_toolkit.attention.flex import FLEX_BLOCK, compiled_flex_attention
from torch.nn.attention.flex_attention import BlockMask

k_rect, v_rect = (t.view(S.batch, capacity, S.heads, S.head_dim).transpose(1, 2)
                  for t in (k_cache, v_cache))  # (B, H, capacity, D): the cache, read in place
in_use = used.clone()  # the lengths the mask reads, updated in place


def within_length(b, h, q_idx, kv_idx):
    return kv_idx < in_use[b]


n_blocks = -(-capacity // FLEX_BLOCK)
kv_num_blocks = torch.zeros(S.batch, 1, 1, dtype=torch.int32, device=DEVICE)
kv_indices = torch.arange(n_blocks, dtype=torch.int32, device=DEVICE).expand(S.batch, 1, 1, n_blocks)
decoding_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices.contiguous(), BLOCK_SIZE=FLEX_BLOCK,
                                         mask_mod=within_length, seq_lengths=(1, capacity))


@torch.no_grad()
def flex_refreshed():  # a decoding step: the mask's lengths refreshed, nothing rebuilt
    in_use.copy_(used)
    kv_num_blocks.copy_((-(-used // FLEX_BLOCK)).view(-1, 1, 1))
    return compiled_flex_attention(q_one[:, :, None], k_rect, v_rect, block_mask=decoding_mask)


# %%
# The baseline, and one row with a mask
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The ``padded`` backend pads inside the call, a gather and a scatter that a
# model written for padded batches never pays. So the baseline of every job
# is attention on tensors padded from the start, ``(B, H, S, D)``: one SDPA
# call with ``is_causal`` (with right padding, a causal query never reaches
# a padding key). For decoding it is a fixed-shape step, as ``CachedStep``
# of :doc:`ragged_decoding_kv_cache_gqa` runs: the cache as a rectangle, the
# rows up to the longest in use scored, those not in use masked. *One row
# with a mask* is the whole batch as one sequence ``(1, H, T, D)`` with a
# ``(T, T)`` block-diagonal causal mask, what ``transformers`` builds from
# the position ids of a packed row: every pair of the row scored.

import torch.nn.functional as F
from ragged_toolkit.attention.reference import reference_attention
from ragged_toolkit.batches import from_padded, to_padded, token_index
from ragged_toolkit.device import tolerances
from ragged_toolkit.measuring.timing import measure
from ragged_toolkit.measuring.tables import print_timings

qh, kh, vh = (to_padded(t, offsets)[0].transpose(1, 2).contiguous() for t in (q, k, v))  # (B, H, S, D)
grad_packed = randn(T, S.heads, S.head_dim)  # the gradient of a loss, zero at padding:
grad_h = to_padded(grad_packed, offsets)[0].transpose(1, 2)  # padding adds nothing to ``dk``, ``dv``
qh_train, kh_train, vh_train = (t.detach().requires_grad_() for t in (qh, kh, vh))
n_used = int(used.max())
seq_id, position = token_index(offsets)[0], torch.arange(T, device=DEVICE)
row_mask = (seq_id[:, None] == seq_id) & (position[:, None] >= position)  # (T, T)
qr, kr, vr = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, H, T, D)
qr_train, kr_train, vr_train = (t.detach().requires_grad_() for t in (qr, kr, vr))


@torch.no_grad()
def padded_inference(k=kh, v=vh):  # (B, H, S, D)
    return F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=k.shape[1] != qh.shape[1])


def padded_training():
    out = F.scaled_dot_product_attention(qh_train, kh_train, vh_train, is_causal=True)
    return torch.autograd.grad(out, (qh_train, kh_train, vh_train), grad_h)


@torch.no_grad()
def padded_decoding():  # (B, H, 1, D)
    mask = torch.arange(n_used, device=DEVICE) < used[:, None]  # (B, n_used): the rows in use
    return F.scaled_dot_product_attention(q_one[:, :, None], k_rect[:, :, :n_used], v_rect[:, :, :n_used],
                                          attn_mask=mask[:, None, None])


@torch.no_grad()
def row_inference(k=kr, v=vr):  # (1, H, T, D)
    return F.scaled_dot_product_attention(qr, k, v, attn_mask=row_mask, enable_gqa=k.shape[1] != qr.shape[1])


def row_training():
    out = F.scaled_dot_product_attention(qr_train, kr_train, vr_train, attn_mask=row_mask)
    return torch.autograd.grad(out, (qr_train, kr_train, vr_train), grad_packed.transpose(0, 1)[None])


def unpad(out):  # (B, H, S, D) -> packed (T, H, D), float32 for the comparison
    return from_padded(out.transpose(1, 2), offsets).float()


def unrow(out):  # (1, H, T, D) -> (T, H, D)
    return out[0].transpose(0, 1).float()


def one_query(out):  # (B, H, 1, D) -> (B, H, D)
    return out[:, :, 0].float()


kh_gqa, vh_gqa = kh[:, :KV_HEADS].contiguous(), vh[:, :KV_HEADS].contiguous()  # as a GQA model holds them
kr_gqa, vr_gqa = kr[:, :KV_HEADS], vr[:, :KV_HEADS]
OTHER_PATHS = {  # (job, path) -> the call, and how its output becomes packed (T, H, D)
    ("inference", "padded tensors"): (padded_inference, unpad),
    ("training", "padded tensors"): (padded_training, unpad),
    ("decoding", "padded tensors"): (padded_decoding, one_query),
    ("GQA", "padded tensors"): (lambda: padded_inference(kh_gqa, vh_gqa), unpad),
    ("inference", "one row + mask"): (row_inference, unrow),
    ("training", "one row + mask"): (row_training, unrow),
    ("GQA", "one row + mask"): (lambda: row_inference(kr_gqa, vr_gqa), unrow),
    ("decoding", "flex (refreshed)"): (flex_refreshed, one_query),
}
q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
causal = reference_attention(q32, k32, v32, offsets, is_causal=True)
REFERENCE = {  # job -> what its paths must return, in float32
    "inference": (causal.detach(),),
    "training": torch.autograd.grad(causal, (q32, k32, v32), grad_packed.float()),  # ``dq``, ``dk``, ``dv``
    "decoding": (reference_attention(q_one, k_cache, v_cache, one_each, cache_offsets, kv_used=used),),
    "GQA": (reference_attention(q, k_gqa, v_gqa, offsets, is_causal=True),),
}
for key, (call, packed) in OTHER_PATHS.items():  # key: (job, path)
    got = call()
    for g, want in zip(got if key[0] == "training" else (got,), REFERENCE[key[0]]):
        torch.testing.assert_close(packed(g), want, **tolerances(DTYPE), msg=lambda m, key=key: f"{key}: {m}")
calls = {key: call for key, (call, _) in OTHER_PATHS.items()}
other_times = measure(calls, min_run_time=S.run_time, profile=not setup.quick)
for key, timing in other_times.items():  # key: (job, path)
    table[key[0]][key[1]] = timing
print_timings({", ".join(key): timing for key, timing in other_times.items()})
table["decoding"]["one row + mask"] = "a cache with spare rows needs kv_used, not one row"
rebuilt, refreshed = table["decoding"].get("flex"), table["decoding"]["flex (refreshed)"]
if hasattr(rebuilt, "median_ms"):
    print(f"flex, one decoding step: mask rebuilt {rebuilt.median_ms:.2f} ms, refreshed "
          f"{refreshed.median_ms:.2f} ms: {rebuilt.median_ms / refreshed.median_ms:.1f}x")

# %%
# A custom score function
# ~~~~~~~~~~~~~~~~~~~~~~~
# ``ragged_attention`` takes no score function: only FlexAttention accepts
# arbitrary Python (``score_mod``), compiled into its kernel. A dense SDPA
# call takes a precomputed additive bias instead: one per sequence for the
# loop, one for the padded square. ``varlen_attn`` and SDPA on nested tensors
# take neither. Each path is checked against a float32 reference.

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

slopes = torch.exp2(-8.0 * torch.arange(1, S.heads + 1, device=DEVICE) / S.heads)  # (H,)


def alibi_penalty(score, b, h, q_idx, kv_idx):  # q_idx, kv_idx: packed positions
    return score - slopes[h] * (q_idx - kv_idx)


def causal_within_sequence(b, h, q_idx, kv_idx):
    return (seq_id[q_idx] == seq_id[kv_idx]) & (q_idx >= kv_idx)


@torch.compile(dynamic=False)
def flex_alibi(q, k, v, block_mask):
    return flex_attention(q, k, v, score_mod=alibi_penalty, block_mask=block_mask)


def alibi_bias(n):  # (H, n, n): the penalty, and -inf above the diagonal
    distance = (torch.arange(n, device=DEVICE)[:, None] - torch.arange(n, device=DEVICE))
    return (-slopes[:, None, None] * distance.float()).masked_fill(distance < 0, float("-inf"))


score_mask = create_block_mask(causal_within_sequence, None, None, T, T, device=DEVICE)
q_seqs, k_seqs, v_seqs = (t.split(lengths.tolist()) for t in (q, k, v))
loop_biases = [alibi_bias(len(a)).to(DTYPE)[None] for a in q_seqs]  # built once per batch
valid = to_padded(q, offsets)[1]  # (B, S)
pad_bias = alibi_bias(qh.shape[2]).masked_fill(~valid[:, None, None, :], float("-inf")).to(DTYPE)


@torch.no_grad()
def alibi_flex():
    return flex_alibi(qr, kr, vr, score_mask)[0].transpose(0, 1)  # (T, H, D)


@torch.no_grad()
def alibi_loop():  # one SDPA call per sequence, on (1, H, L, D) views
    return torch.cat([F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (a, b, c)),
                                                     attn_mask=bias)[0]
                      for a, b, c, bias in zip(q_seqs, k_seqs, v_seqs, loop_biases)], 1).transpose(0, 1)


@torch.no_grad()
def alibi_padded():
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=pad_bias)


with sdpa_kernel(SDPBackend.MATH):  # float32, and no kernel shared with the paths checked
    alibi_reference = torch.cat([F.scaled_dot_product_attention(
        *(t.float().transpose(0, 1) for t in (a, b, c)), attn_mask=alibi_bias(len(a))
    ).transpose(0, 1) for a, b, c in zip(q_seqs, k_seqs, v_seqs)])
ALIBI = {"flex": (alibi_flex, lambda out: out.float()), "loop": (alibi_loop, lambda out: out.float()),
         "padded tensors": (alibi_padded, unpad)}
for path, (call, packed) in ALIBI.items():
    torch.testing.assert_close(packed(call()), alibi_reference, **tolerances(DTYPE), msg=lambda m, p=path: f"{p}: {m}")
alibi_calls = {path: call for path, (call, _) in ALIBI.items()}
table["score_mod"] = {
    "one row + mask": "possible with a bias over the whole row; not written here",
    "varlen": "no score function or bias argument",
    "sdpa_njt": "SDPA on nested tensors takes no mask or bias",
    "bucketed": "possible with a bias per bucket; not written here",
    "padded": "takes no bias (the padded tensors do)",
    **measure(alibi_calls, min_run_time=S.run_time, profile=not setup.quick),
}
print("score_mod (ALiBi, causal, forward):")
print_timings(table["score_mod"])

# %%
# Serving: a continuous batch over a paged KV cache
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# One step of continuous batching, built with the serving code of
# :doc:`serving_continuous_batching`: four newcomers (the longest requests)
# feed the last chunk of their prompts, every other one its last generated
# token; the keys
# live in blocks of a ``PagedKVCache``, handed out as the requests grew side
# by side; ``build_step`` packs the step and builds, once for every layer,
# what the path reads the cache with. The paths:
#
# .. literalinclude:: ../ragged_toolkit/serving/paged_attention.py
#    :pyobject: gathered_attention
#
# .. literalinclude:: ../ragged_toolkit/serving/paged_attention.py
#    :pyobject: flex_paged_attention
#
# .. literalinclude:: ../ragged_toolkit/serving/paged_attention.py
#    :pyobject: varlen_paged_attention
#
# ``gathered`` runs ``ragged_attention`` with a backend (``loop``,
# ``bucketed``, ``padded`` below); ``flex`` reads the cache through a paged
# block mask (``paged_block_mask``, on the serving page). The baseline is the
# padded layout a server without ragged attention runs: the decode tokens as
# one-query rows against their keys padded to the longest, and the prompt
# chunks padded apart, each query seeing the keys up to its own position.

from ragged_toolkit.gpt import GPTConfig
from ragged_toolkit.kv_cache import PagedKVCache, paged_rows
from ragged_toolkit.serving.engine import build_step
from ragged_toolkit.serving.paged_attention import PAGED_PATHS, paged_varlen_support
from ragged_toolkit.serving.requests import Request

CHUNK = 16  # prompt tokens a newcomer feeds per step
cfg = GPTConfig(vocab_size=256, dim=S.heads * S.head_dim, n_layers=1, n_heads=S.heads, n_kv_heads=S.heads,
                ffn_hidden=4 * S.heads * S.head_dim, max_seq_len=capacity)
newcomers = lengths.argsort(descending=True)[:4].tolist()  # the four longest: their prompts are still fed
requests = [Request(rid, [0] * n, n_out=1, computed=max(n - CHUNK, 0)) if rid in newcomers  # a last chunk
            else Request(rid, [0] * (n - 1), n_out=2, generated=[0], computed=n - 1)  # a decode token
            for rid, n in enumerate(lengths.tolist())]
cache = PagedKVCache(cfg, sum(-(-r.length() // S.block) for r in requests), S.block, DEVICE, DTYPE)
for grown in range(S.block, int(lengths.max()) + S.block, S.block):  # block by block, side by side
    assert all(cache.reserve(r.rid, min(grown, r.length())) for r in requests)
cache.k[0], cache.v[0] = randn(*cache.k.shape[1:]), randn(*cache.v.shape[1:])  # the keys written so far
work = [(r, r.pending()) for r in requests]  # (request, tokens it feeds)


def paged_call(path, backend=None):
    """The step's attention through ``path``: its layout built once, as
    every layer of the step shares it; returns the call."""
    _, _, layout = build_step(cache, work, DEVICE, path, backend)  # tokens, positions, layout
    q_step = q[:int(layout.q_offsets[-1])]  # (T_step, H, D)
    return lambda: PAGED_PATHS[path](q_step, layout, 0)


_, _, step = build_step(cache, work, DEVICE, "varlen")  # the step's offsets, lengths and block table
q_len, kv_len = step.q_offsets.diff(), step.kv_lengths
q_step, q_seq = q[:int(step.q_offsets[-1])], token_index(step.q_offsets)[0]
rows = paged_rows(step.block_table, kv_len, S.block)  # every key in use, request after request
keys, values, kv_seq = cache.k[0][rows], cache.v[0][rows], token_index(offsets_from_lengths(kv_len, DEVICE))[0]
serving_reference = reference_attention(q_step, keys, values, step.q_offsets, offsets_from_lengths(kv_len, DEVICE),
                                        is_causal=True)


def padded_apart(group):
    """The requests where ``group`` (``(B,)``) is true, as padded tensors: queries
    (B_g, H, S_q, D), keys and values (B_g, H, S_kv, D), the mask of the keys
    each query sees (B_g, 1, S_q, S_kv), and the queries' offsets, by name."""
    q_offsets = offsets_from_lengths(q_len[group], DEVICE)
    qp = to_padded(q_step[group[q_seq]], q_offsets)[0].transpose(1, 2)
    kp, vp = (to_padded(t[group[kv_seq]], offsets_from_lengths(kv_len[group], DEVICE))[0].transpose(1, 2)
              for t in (keys, values))
    i, j = torch.arange(qp.shape[2], device=DEVICE), torch.arange(kp.shape[2], device=DEVICE)
    shift = (kv_len - q_len)[group][:, None, None]  # a query at i sees the keys up to i + shift
    sees = (j <= i[:, None] + shift) & (j < kv_len[group][:, None, None])
    return dict(q=qp, k=kp, v=vp, mask=sees[:, None], q_offsets=q_offsets)


GROUPS = {"decode tokens": q_len == 1, "prompt chunks": q_len > 1}
PADDED_APART = {name: padded_apart(group) for name, group in GROUPS.items()}


@torch.no_grad()
def serving_padded():  # two SDPA calls: the decode rows, the prompt chunks
    return {name: F.scaled_dot_product_attention(g["q"], g["k"], g["v"], attn_mask=g["mask"])
            for name, g in PADDED_APART.items()}


for name, out in serving_padded().items():
    torch.testing.assert_close(from_padded(out.transpose(1, 2), PADDED_APART[name]["q_offsets"]).float(),
                               serving_reference[GROUPS[name][q_seq]], **tolerances(DTYPE))
serving_runs = {"padded tensors": serving_padded, "flex": paged_call("flex"),
                **{name: paged_call("gathered", name) for name in ("loop", "bucketed", "padded")}}
why_varlen = paged_varlen_support(DEVICE, DTYPE, S.block)
if why_varlen is None:
    serving_runs["varlen"] = paged_call("varlen")
with torch.no_grad():
    for path, call in serving_runs.items():
        if path != "padded tensors":
            torch.testing.assert_close(call().float(), serving_reference, **tolerances(DTYPE),
                                       msg=lambda m, p=path: f"serving, {p}: {m}")
# the query-key pairs each side scores: the padded groups their rectangles,
# the ragged step each query's keys up to its own position
padded_pairs = sum(g["mask"].numel() for g in PADDED_APART.values())  # (B_g, 1, S_q, S_kv) each
serving_pairs = float((q_len * kv_len - q_len * (q_len - 1) / 2).sum())
table["serving"] = {
    "one row + mask": "not written for a paged cache",
    "varlen": why_varlen,
    "sdpa_njt": "SDPA on nested tensors aligns is_causal top-left: not for more keys than queries",
    **measure(serving_runs, min_run_time=S.run_time, profile=not setup.quick),
}
print(f"serving ({S.batch} requests in blocks of {S.block} rows: {int(GROUPS['prompt chunks'].sum())} prompt chunks, "
      f"{int(GROUPS['decode tokens'].sum())} decode tokens):")
print_timings(table["serving"])

# %%
# The decision guide, from this build
# -----------------------------------
# For each job: the path chosen here, its median and kernels, its speedup
# over the padded tensors beside the job's :term:`work bound` and the
# :term:`fraction of the bound` it reaches, what to use next, and which
# paths cannot take the job here (the lines above say why). ``choose`` takes
# the fastest path only where its interquartile range (IQR) does not overlap
# the next one's; within the noise it keeps the default, ``default_backend``
# (the loop on a CPU). The bound counts query-key pairs: the causal half for
# causal jobs (a causal kernel skips the rest); the whole square for the
# score function (its padded baseline and loop bias all of it); for
# decoding, the cached rows up to the longest in use; for serving, the
# rectangles of the two padded groups.

from ragged_toolkit.attention import BACKENDS, default_backend
from ragged_toolkit.measuring.bound import Work, speedup_line, work_bound
from ragged_toolkit.measuring.noise import choose, outside_noise
from ragged_toolkit.measuring.tables import Table
from ragged_toolkit.measuring.timing import Timing

PAIRS = Work(per_token=0.0, per_pair=1.0)  # attention's work: the query-key pairs scored
causal_bound = work_bound(lengths, work=PAIRS, causal=True)
BOUND = {"inference": causal_bound, "training": causal_bound, "GQA": causal_bound,
         "decoding": work_bound(torch.ones_like(lengths), lengths, work=PAIRS),  # one query, its keys in use
         "score_mod": work_bound(lengths, work=PAIRS), "serving": padded_pairs / serving_pairs}
ROWS = ("padded tensors", "one row + mask", *BACKENDS, "flex (refreshed)")  # every path, the baseline first
BEYOND = {  # what two other pages measure for these jobs
    "serving": "\nwith shared prompts: a prefix cache, and shared-prefix attention where many requests "
               "share a long prefix (serving_shared_prompts)",
    "training": "\nhybrid models: recurrent layers reset at every document (packed_recurrent_layers)"}
guide = []
for job, results in table.items():
    ran = {name: r for name, r in results.items() if isinstance(r, Timing)}
    best = choose(ran, (default_backend(DEVICE, DTYPE, S.head_dim), "loop"), f"{job} path")
    then = sorted((name for name in ran if name != best), key=lambda name: ran[name].median_ms)
    ragged = best if best != "padded tensors" else then[0]  # where padding wins, the best of the others
    padded, bound = ran["padded tensors"], BOUND[job]
    print(speedup_line(f"{job}, {ragged} against padded tensors", padded, ran[ragged], bound))
    gain = padded.median_ms / ran[ragged].median_ms
    chosen = f"{best}, {ran[best].median_ms:.2f} ms" + (f"\nkernels: {ran[best].kernels}" if ran[best].kernels else "")
    versus = ((f"{ragged}: " if ragged != best else "") + f"speedup {gain:.2f}x\nwork bound {bound:.2f}x\n"
              f"fraction {gain / bound:.2f}" + ("" if outside_noise(padded, ran[ragged]) else " (within noise)"))
    guide.append([job, chosen, versus, ", ".join(then) + BEYOND.get(job, ""),
                  ", ".join(name for name, r in results.items() if not isinstance(r, Timing))])
Table(["job", "chosen here", "against padded tensors", "then", "not here"], guide, css_class="decision-guide")

# %%
# The same speedups for every path
# --------------------------------
# Each cell is a path's measured speedup over the padded tensors for that
# job (higher is better) and, in brackets, its fraction of the job's work
# bound (what that fraction tells, and what it does not:
# :doc:`measuring_ragged_batches`).

import matplotlib.pyplot as plt
from ragged_toolkit.figures import FIGURE_STYLE, draw_speedups

plt.rcParams.update(FIGURE_STYLE)
speedup = np.array([[table[job]["padded tensors"].median_ms / table[job][name].median_ms
                     if isinstance(table[job].get(name), Timing) else np.nan for job in table] for name in ROWS])
draw_speedups(speedup, ROWS, list(table), [BOUND[job] for job in table],
              f"Measured speedup over padded tensors, {DEVICE}, {str(DTYPE).removeprefix('torch.')}\n"
              "(in brackets: fraction of the computed work bound)")
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# How to read it
# --------------
# The ranking holds for this device, this dtype and these lengths: re-run
# the page (or ``compare_backends`` on your own batch) on the machine you
# will train or serve on, and profile a path's call to see why it wins or
# loses (:doc:`measuring_ragged_batches`). A few things hold everywhere,
# because they follow from what each path computes:
#
# * padding does the work of ``B x S_max`` tokens whatever the lengths, so
#   its cost grows with the longest sequence, not with the batch's tokens;
# * the per-sequence loop does exactly the real work but pays one call per
#   sequence, so it suits few long sequences better than many short ones;
# * a decoding step pays for whatever its path prepares per batch, at every
#   step: a plan that needs no mask, or a mask refreshed in place, keeps
#   that cost small;
# * one row with a mask scores every pair of the row, so its cost grows with
#   the square of the batch's tokens, not with the sum of its sequences';
# * FlexAttention is the only path here that takes an arbitrary score
#   function; whether it has a backward on this device, ``backend_support``
#   says (on a CPU it has none);
# * attention is not every layer: a hybrid model's recurrent layers need
#   their state and convolution reset at every document of a packed row
#   (:doc:`packed_recurrent_layers`), and a server whose requests share
#   prompts gains most from caching them (:doc:`serving_shared_prompts`);
#   those pages measure what each buys on the build's device.
#
# References
# ----------
# * `scaled_dot_product_attention
#   <https://docs.pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html>`_
# * `FlexAttention <https://pytorch.org/blog/flexattention/>`_;
#   `FlexAttention for inference <https://pytorch.org/blog/flexattention-for-inference/>`_
# * `varlen_attn <https://docs.pytorch.org/docs/stable/nn.attention.varlen.html>`_
