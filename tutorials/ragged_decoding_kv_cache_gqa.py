"""
Decoding ragged batches: a KV cache, grouped-query attention and varlen attention
=================================================================================

Generate from a batch of prompts of different lengths with a key/value cache
that holds each sequence's own length, shrink that cache with grouped-query
attention, and see where varlen attention fits.

**Author:** the tutorials maintainers, building on the transformer building
blocks tutorial by `Mikayla Gawarecki <https://github.com/mikaylagawarecki>`_

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How to prefill a batch of prompts of different lengths without
         padding, then decode greedily with a key/value cache that keeps each
         sequence's own length
       * How to prove the cache correct: at every step, the cached logits
         match a full recomputation for every sequence
       * How grouped-query attention shrinks the cache, with
         ``scaled_dot_product_attention(..., enable_gqa=True)`` and
         ``flex_attention(..., enable_gqa=True)`` over a packed batch
       * How ``torch.nn.attention.varlen.varlen_attn`` consumes the offsets of
         a ragged batch, and what runs in its place without CUDA

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.11 or later (checked on 2.11 and 2.13 on CPU; the CUDA
         cells are written for those versions but were not run for this build)
       * Runs on CPU; the ``varlen_attn`` cells need a CUDA GPU of compute
         capability 8.0 or newer and fall back to FlexAttention without one

The transformer building blocks tutorial left three sections pending in 2024:
key/value caching on nested tensors, grouped-query attention (GQA) on nested
tensors and FlexAttention on nested tensors. Two waited for pull requests;
the third had no plan yet. Since then the ground has moved. The nested tensor
documentation now opens with "Nested tensors are not currently under active
development", FlexAttention no longer accepts nested inputs, and PyTorch
points ragged attention at *packed* sequences: all tokens of a batch laid end
to end, with a vector of offsets saying where each sequence starts. The
tutorials project plans to move from nested tensors to varlen attention
(`pytorch/tutorials#3727 <https://github.com/pytorch/tutorials/issues/3727>`_). That is what a jagged nested tensor
(NJT) holds internally, so the NJT stays useful as a container, and its
``values()`` and ``offsets()`` are what the attention kernels consume.

This page writes the three sections for today's PyTorch, on one small
decoder-only model:

1. **KV-cache decoding.** Prefill a ragged batch of prompts, then append one
   token per sequence per step to a cache, and check every step against a
   recomputation without the cache.
2. **Grouped-query attention.** The same model with fewer key/value heads than
   query heads, on dense SDPA and on FlexAttention over the packed batch.
3. **varlen attention.** ``varlen_attn`` with cumulative sequence lengths taken
   from the batch's offsets, checked against SDPA on an NJT and against
   FlexAttention with a document mask.
"""

# sphinx_gallery_tags = ["KV cache", "GQA", "varlen attention", "FlexAttention"]

# %%
# Setup
# -----
# First the checks that decide what can run. The page needs PyTorch 2.11 or
# later for everything it does on CPU (FlexAttention with ``enable_gqa``, SDPA with
# ``enable_gqa``, jagged nested tensors); ``varlen_attn`` additionally needs a
# CUDA device and half precision. Instead of failing half way with a
# traceback, the cell prints what is missing and what runs instead.
#
# Two warnings that compiled nested-tensor code prints are filtered by their
# message, and so is the "Failed to pickle cache key" record from inductor, which
# is logged with a traceback rather than warned. Nothing else is silenced.

import logging
import os
import warnings

import torch

warnings.filterwarnings("ignore", message=r".*_stable_hash_for_caching.*")
warnings.filterwarnings("ignore", message=r".*nested tensors is in prototype stage.*")


class _DropPickleCacheKey(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to pickle cache key" not in record.getMessage()


logging.getLogger("torch._inductor.codecache").addFilter(_DropPickleCacheKey())

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if TORCH_VERSION < (2, 11):
    raise RuntimeError(
        f"This page needs PyTorch 2.11 or later (FlexAttention and SDPA with "
        f"enable_gqa, jagged nested tensors, torch.nn.attention.varlen); found "
        f"{torch.__version__}. Install a newer torch and run it again."
    )

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUICK = os.environ.get("TUTORIALS_QUICK") == "1"

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # older builds have no varlen module
    varlen_attn = None

# ``varlen_attn`` calls Flash Attention: CUDA, compute capability 8.0 or
# newer, ``float16`` or ``bfloat16`` (``bfloat16`` where the GPU supports it).
FLASH_GPU = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (8, 0)
HALF = None
if FLASH_GPU:
    HALF = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
HAS_VARLEN = varlen_attn is not None and FLASH_GPU

print(f"torch {torch.__version__}, device: {DEVICE}, quick mode: {QUICK}")
if HAS_VARLEN:
    print(f"varlen_attn: available, runs in {HALF}")
elif varlen_attn is None:
    print("varlen_attn: not in this torch build; FlexAttention runs in its place")
elif DEVICE == "cuda":
    print("varlen_attn: needs a GPU of compute capability 8.0 or newer (Flash "
          "Attention); FlexAttention runs in its place")
else:
    print("varlen_attn: needs a CUDA GPU (Flash Attention kernel, float16 or "
          "bfloat16); FlexAttention runs in its place")

# %%
# Sizes
# ~~~~~
# Every size on the page is set here, per device. The model is tiny and
# randomly initialized (seeded): the point is the mechanics and their
# correctness, not the text it writes. For scale, Llama-2-7B has a model
# width of 4096, 32 layers, 32 query heads of size 128 and a 4096-token
# context; Llama-2-70B uses GQA with 8 key/value heads for 64 query heads.

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    max_seq_len: int
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# Reduced sizes, with typical serving values for a 7B-class model in
# brackets: batch (64-256 sequences), prompt length (thousands of tokens),
# new tokens (hundreds), width (4096), layers (32), query heads (32),
# key/value heads (8 with GQA).
if DEVICE == "cuda":
    # one GPU, a few minutes: width 1024, 8 layers, 16 query heads, 4 key/value heads
    BATCH, MIN_PROMPT, MAX_PROMPT, N_NEW = 64, 16, 1024, 128
    GEN_LENGTHS = [16, 32, 64, 128]
    ARGS = ModelArgs(vocab_size=32000, dim=1024, n_layers=8, n_heads=16,
                     n_kv_heads=4, ffn_hidden=2816, max_seq_len=MAX_PROMPT + N_NEW)
    VARLEN_BATCH, VARLEN_MAX = 64, 2048
elif QUICK:
    # TUTORIALS_QUICK=1: the smallest sizes that still exercise every path
    BATCH, MIN_PROMPT, MAX_PROMPT, N_NEW = 6, 4, 48, 12
    GEN_LENGTHS = [4, 12]
    ARGS = ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=8,
                     n_kv_heads=2, ffn_hidden=176, max_seq_len=MAX_PROMPT + N_NEW)
    VARLEN_BATCH, VARLEN_MAX = 8, 64
else:
    # CPU, 2 cores, the whole page in a few minutes: batch 16, prompts of
    # 4-96 tokens, 32 new tokens, width 128, 4 layers, 8 query heads, 2 key/value heads
    BATCH, MIN_PROMPT, MAX_PROMPT, N_NEW = 16, 4, 96, 32
    GEN_LENGTHS = [4, 8, 16, 32]
    ARGS = ModelArgs(vocab_size=512, dim=128, n_layers=4, n_heads=8,
                     n_kv_heads=2, ffn_hidden=352, max_seq_len=MAX_PROMPT + N_NEW)
    VARLEN_BATCH, VARLEN_MAX = 32, 128

MHA_ARGS = replace(ARGS, n_kv_heads=ARGS.n_heads)  # multi-head baseline
GQA_ARGS = ARGS  # ``n_heads // n_kv_heads`` query heads share each key/value head
MIN_RUN_TIME = 0.2 if QUICK else 0.5  # seconds per ``blocked_autorange``
REPEATS = 3 if QUICK else 5  # full generation runs per throughput figure
SEED = 0
DTYPE = torch.float32  # the model; varlen needs HALF, see above
print(f"batch {BATCH}, prompts {MIN_PROMPT}..{MAX_PROMPT} tokens, {N_NEW} new tokens")
print(f"model: width {ARGS.dim}, {ARGS.n_layers} layers, {ARGS.n_heads} query heads of "
      f"{ARGS.head_dim}, key/value heads: {MHA_ARGS.n_kv_heads} (MHA) or "
      f"{GQA_ARGS.n_kv_heads} (GQA), vocabulary {ARGS.vocab_size}")

# %%
# A ragged batch of prompts
# -------------------------
# Prompt lengths follow a Zipf-like law truncated to
# ``[MIN_PROMPT, MAX_PROMPT]``: the probability of length ``n`` is
# proportional to ``n ** -alpha``, so most prompts are short and a few are
# long, as in real traffic. One vectorized draw from a seeded
# ``numpy.random.Generator`` gives the same batch on every run.

import numpy as np

torch.manual_seed(SEED)
rng = np.random.default_rng(SEED)


def zipf_lengths(rng: np.random.Generator, n: int, lo: int, hi: int,
                 alpha: float = 1.1) -> torch.Tensor:
    support = np.arange(lo, hi + 1)
    p = support.astype(np.float64) ** -alpha
    return torch.from_numpy(rng.choice(support, size=n, p=p / p.sum()))


prompt_lengths = zipf_lengths(rng, BATCH, MIN_PROMPT, MAX_PROMPT)
# A jagged nested tensor of token ids: shape (B, j1), one row per prompt.
prompts = torch.nested.nested_tensor(
    [torch.randint(ARGS.vocab_size, (int(n),)) for n in prompt_lengths],
    layout=torch.jagged, device=DEVICE,
)
print(f"prompt lengths: {prompt_lengths.tolist()}")
print(f"{int(prompt_lengths.sum())} tokens in total, longest {int(prompt_lengths.max())}; "
      f"padding to the longest would hold {BATCH * int(prompt_lengths.max())}")
print(f"offsets: {prompts.offsets().tolist()}")

# %%
# Everything below works on the packed form: ``prompts.values()`` is a 1-D
# tensor of all ``T`` tokens, and ``prompts.offsets()`` (``B + 1`` entries)
# marks where each prompt starts. Two derived vectors describe every token:
# which sequence it belongs to (``doc``) and its position inside that
# sequence (``pos``, used by the rotary embedding and by the cache).


@dataclass
class Ragged:
    offsets: torch.Tensor  # (B + 1,) int64, offsets[0] == 0
    doc: torch.Tensor  # (T,) sequence index of each token
    pos: torch.Tensor  # (T,) position of each token inside its sequence
    lengths: list  # B Python integers, for splitting without a device sync


def ragged_from_lengths(lengths: torch.Tensor) -> Ragged:
    lengths = lengths.to(DEVICE)
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=DEVICE), lengths)
    pos = torch.arange(int(offsets[-1]), device=DEVICE) - offsets[doc]
    return Ragged(offsets, doc, pos, lengths.tolist())


prompt_batch = ragged_from_lengths(prompts.offsets().diff())

# %%
# A small GPT
# -----------
# The model is the usual decoder-only stack, written flat in the style of
# ``gpt-fast``: token embedding, ``n_layers`` norm-first blocks of causal attention
# and a SwiGLU feed-forward network with residual connections, a final norm
# and an output projection. Rotary position embeddings (RoPE) rotate queries
# and keys by each token's position inside its own sequence, which is why
# ``pos`` matters: in a packed batch the global token index means nothing.
#
# Every tensor inside is packed, ``(T, ...)``, with no batch dimension. The
# only step that needs to know where sequences begin and end is attention,
# so the model does not do it itself: each call receives an ``attend``
# function, ``attend(layer, q, k, v) -> out`` on ``(T, heads, head_dim)``
# tensors. Prefill, decoding with a cache and recomputation without one are
# different ``attend`` functions around the same weights.

import torch.nn as nn
import torch.nn.functional as F


def rope_tables(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    half = args.head_dim // 2
    freqs = args.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
    return angles.cos().to(DTYPE), angles.sin().to(DTYPE)  # (``max_seq_len``, half)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (T, heads, head_dim); cos, sin: (T, 1, head_dim // 2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        kv_dim = args.n_kv_heads * args.head_dim
        self.wqkv = nn.Linear(args.dim, args.dim + 2 * kv_dim, bias=False)  # packed
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.split = [args.dim, kv_dim, kv_dim]

    def forward(self, x, cos, sin, attend, layer):
        T = x.shape[0]  # x: (T, dim)
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = apply_rope(q.view(T, self.n_heads, self.head_dim), cos, sin)  # (T, H, D)
        k = apply_rope(k.view(T, self.n_kv_heads, self.head_dim), cos, sin)  # (T, Hkv, D)
        v = v.view(T, self.n_kv_heads, self.head_dim)  # (T, Hkv, D)
        return self.wo(attend(layer, q, k, v).reshape(T, -1))  # (T, dim)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.ffn_hidden, bias=False)  # packed
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)

    def forward(self, x):
        x1, x3 = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(x1) * x3)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(args.dim), nn.RMSNorm(args.dim)
        self.attn, self.ffn = Attention(args), FeedForward(args)

    def forward(self, x, cos, sin, attend, layer):
        x = x + self.attn(self.attn_norm(x), cos, sin, attend, layer)
        return x + self.ffn(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens, pos, attend):
        # ``tokens``, ``pos``: (T,) -> logits: (T, ``vocab_size``)
        x = self.tok_embeddings(tokens)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)  # (T, 1, D/2)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attend, i)
        return self.output(self.norm(x))


torch.manual_seed(SEED)
mha_model = GPT(MHA_ARGS).to(DEVICE).eval()
print(f"{sum(p.numel() for p in mha_model.parameters()) / 1e6:.2f} M parameters")

# %%
# Attention without a cache: one causal SDPA per sequence
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The simplest correct ``attend`` for a packed batch splits it at the
# offsets and runs a causal ``scaled_dot_product_attention`` on each
# sequence. It needs no mask and no compiler, works with GQA through
# ``enable_gqa=True``, and on a few CPU cores it is often as fast as the
# alternatives. The jagged SDPA would be the natural call here, but on CPU it
# refuses ``is_causal=True``, and a causal decoder is exactly what needs it.
# This function is also the reference the cache is checked against.


def attend_per_sequence(batch: Ragged):
    def attend(layer, q, k, v):
        outs = [
            F.scaled_dot_product_attention(
                qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1),
                is_causal=True, enable_gqa=True,
            ).transpose(0, 1)  # (n_i, H, D)
            for qi, ki, vi in zip(q.split(batch.lengths), k.split(batch.lengths),
                                  v.split(batch.lengths))
        ]
        return torch.cat(outs)  # (T, H, D)

    return attend


# %%
# The KV cache
# ------------
# During decoding each sequence adds one token per step, and that token's
# query must see the keys and values of everything before it. Recomputing
# them every step makes the work of generating ``n`` tokens grow with
# ``n`` squared; caching them costs one pass per new token. The question for a ragged
# batch is the layout. Two designs were weighed against each other:
#
# * **Padded, preallocated**: one ``(B, Hkv, S_max, D)`` buffer per layer for
#   keys and one for values, with ``S_max`` the longest prompt plus the
#   number of new tokens, and a ``lengths`` vector of ``B`` entries. Token
#   ``p`` of sequence ``b`` lives at ``[b, :, p]``. A step writes ``B`` rows at
#   ``[arange(B), :, lengths]`` with one advanced-indexing assignment (an
#   ``index_put_``), then attends with one batched SDPA call and a boolean
#   mask ``key_position < length``. The buffer is allocated once and never
#   grows. (This page reads only its filled prefix, ``[:, :, :max(lengths)]``;
#   a decoder compiled with CUDA graphs would read the whole buffer under
#   the same mask, so that every step has the same shapes.)
# * **Packed, ragged**: one ``(sum_b capacity_b, Hkv, D)`` buffer, each
#   sequence owning a slot of ``capacity_b = prompt_b + n_new`` rows that
#   starts at its own offset. It allocates only what each sequence can use.
#   Attention must then respect slot boundaries: a loop of per-sequence SDPA
#   calls, FlexAttention with a mask built from the slots, or on CUDA
#   ``varlen_attn(..., seqused_k=lengths)``, which reads exactly this layout.
#
# A nested tensor does not help with either. An NJT cannot grow along its
# ragged dimension (``torch.cat`` on it fails), so a cache of NJTs would be
# rebuilt at each step; and an NJT *view* of a packed buffer with unused
# capacity, ``nested_tensor_from_jagged(values, offsets, lengths=...)``, is
# a tensor "with holes" that ``to_padded_tensor`` and SDPA refuse.
# ``index_put_`` does work on an NJT, but the buffers below are plain tensors
# anyway.
#
# The page uses the padded layout, for the speed measured in the next cells,
# and shows its memory price next to the packed one. The prefill writes all
# ``T`` prompt tokens with the same indexing, using ``doc`` and ``pos``.


class KVCache:
    """Per-layer ``(B, Hkv, S_max, D)`` keys and values plus a length per sequence."""

    def __init__(self, args: ModelArgs, batch_size: int, max_len: int):
        shape = (args.n_layers, batch_size, args.n_kv_heads, max_len, args.head_dim)
        self.k = torch.zeros(shape, dtype=DTYPE, device=DEVICE)
        self.v = torch.zeros(shape, dtype=DTYPE, device=DEVICE)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=DEVICE)
        self.max_length = 0  # host copy of lengths.max(), so no sync per step
        self.rows = torch.arange(batch_size, device=DEVICE)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prefill(self, batch: Ragged, attend_fn):
        """Write every prompt token, then attend with ``attend_fn`` (no cache read)."""
        inner = attend_fn(batch)

        def attend(layer, q, k, v):
            # (T, Hkv, D) rows land at ``[doc, :, pos]`` of a (B, Hkv, S_max, D) buffer
            self.k[layer][batch.doc, :, batch.pos] = k
            self.v[layer][batch.doc, :, batch.pos] = v
            return inner(layer, q, k, v)

        return attend

    def decode(self, decode_attn):
        """One new token per sequence at position ``lengths[b]``; T == B."""
        new_len = self.lengths + 1  # (B,)
        s = self.max_length + 1  # read only the filled prefix of the buffer
        mask = (torch.arange(s, device=DEVICE) < new_len[:, None])[:, None, None, :]

        def attend(layer, q, k, v):
            self.k[layer][self.rows, :, self.lengths] = k  # (B, Hkv, D)
            self.v[layer][self.rows, :, self.lengths] = v
            keys, values = self.k[layer, :, :, :s], self.v[layer, :, :, :s]
            # q: (B, H, D) -> (B, H, 1, D), one query per sequence
            return decode_attn(q.unsqueeze(2), keys, values, mask, new_len).squeeze(2)

        return attend

    def advance(self, batch_lengths=None):
        if batch_lengths is None:
            self.lengths += 1
            self.max_length += 1
        else:
            self.lengths.copy_(batch_lengths)
            self.max_length = int(batch_lengths.max())


# %%
# Decode attention: measure, then choose
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With the cache filled by a prefill of the prompts, three ways of attending
# one query per sequence to that sequence's own keys are timed:
#
# * **masked SDPA**: one batched call over the ``(B, Hkv, s, D)`` prefix of
#   the buffer with a ``(B, 1, 1, s)`` boolean mask; it computes scores for
#   the padding and throws them away.
# * **per-sequence SDPA**: ``B`` calls, each on exactly ``lengths[b]`` keys.
# * **FlexAttention** (compiled) on the same dense buffer with the mask
#   ``kv_idx < lengths[b]``. Its ``BlockMask`` depends on the lengths, so it
#   has to be rebuilt at every step; the fair cost per layer is the kernel plus
#   ``create_block_mask`` divided by ``n_layers``.
#
# Timings use ``torch.utils.benchmark`` after a warm-up call, with the
# median and the interquartile range (IQR) of the measured blocks.

import time

import torch.utils.benchmark as benchmark
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

flex = torch.compile(flex_attention, dynamic=False)  # static shapes, see below


def timeit(fn, min_run_time=MIN_RUN_TIME):
    """Median and IQR of ``fn()`` in seconds, after one warm-up call."""
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return m.median, m.iqr


def decode_masked_sdpa(q, keys, values, mask, lengths):
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def decode_per_sequence(q, keys, values, mask, lengths):
    return torch.cat([
        F.scaled_dot_product_attention(q[b:b + 1], keys[b:b + 1, :, :n],
                                       values[b:b + 1, :, :n], enable_gqa=True)
        for b, n in enumerate(lengths.tolist())
    ])


def length_block_mask(lengths, s):
    def within_length(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    return create_block_mask(within_length, len(lengths), None, 1, s, device=DEVICE)


torch.manual_seed(SEED)
cache = KVCache(MHA_ARGS, BATCH, MAX_PROMPT + N_NEW)
with torch.no_grad():
    mha_model(prompts.values(), prompt_batch.pos, cache.prefill(prompt_batch, attend_per_sequence))
cache.advance(prompts.offsets().diff())

s = cache.max_length
lengths = cache.lengths
mask = (torch.arange(s, device=DEVICE) < lengths[:, None])[:, None, None, :]
q = torch.randn(BATCH, MHA_ARGS.n_heads, 1, MHA_ARGS.head_dim, device=DEVICE)
keys, values = cache.k[0, :, :, :s], cache.v[0, :, :, :s]

t0 = time.perf_counter()
block_mask = length_block_mask(lengths, s)
out_flex = flex(q, keys, values, block_mask=block_mask, enable_gqa=True)
flex_compile_s = time.perf_counter() - t0

out_ref = decode_per_sequence(q, keys, values, mask, lengths)
torch.testing.assert_close(decode_masked_sdpa(q, keys, values, mask, lengths), out_ref)
torch.testing.assert_close(out_flex, out_ref)

decode_times = {
    "masked SDPA": timeit(lambda: decode_masked_sdpa(q, keys, values, mask, lengths)),
    "per-sequence SDPA": timeit(lambda: decode_per_sequence(q, keys, values, mask, lengths)),
    "FlexAttention kernel": timeit(lambda: flex(q, keys, values, block_mask=block_mask,
                                                enable_gqa=True)),
}
mask_build = timeit(lambda: length_block_mask(lengths, s))
flex_total = decode_times["FlexAttention kernel"][0] + mask_build[0] / MHA_ARGS.n_layers
print(f"one layer, {BATCH} queries against up to {s} cached keys each "
      f"(FlexAttention compiled in {flex_compile_s:.1f} s):")
for name, (med, iqr) in decode_times.items():
    print(f"  {name:22s} {med * 1e6:8.1f} us  (IQR {iqr * 1e6:.1f} us)")
print(f"  create_block_mask      {mask_build[0] * 1e6:8.1f} us  (IQR {mask_build[1] * 1e6:.1f} us) "
      f"per step; FlexAttention with it shared by {MHA_ARGS.n_layers} layers: "
      f"{flex_total * 1e6:.1f} us per layer")
per_layer = {"masked SDPA": decode_times["masked SDPA"][0],
             "per-sequence SDPA": decode_times["per-sequence SDPA"][0],
             "FlexAttention kernel alone": decode_times["FlexAttention kernel"][0],
             "FlexAttention + block mask": flex_total}
print("  fastest per layer: " + ", then ".join(sorted(per_layer, key=per_layer.get)))

padded_keys = BATCH * s
print(f"  keys scored by masked SDPA: {padded_keys}, of which real: "
      f"{int(lengths.sum())} ({padded_keys / int(lengths.sum()):.1f}x)")

# %%
# What the numbers say, on a CPU with few cores: the per-sequence loop pays
# a fixed cost per call ``B`` times; the FlexAttention kernel is quick, but its
# block mask has to be rebuilt at every step and that costs more than the
# attention itself; the single masked call scores the padding too (the
# ratio is printed above), but with one query per sequence that waste is
# small next to the cost of extra calls. The two plain SDPA variants are
# exact and need no compiler, so the page decodes with whichever of them
# measured faster in this run, printed below.

DECODE_ATTN = min((decode_masked_sdpa, decode_per_sequence),
                  key=lambda f: decode_times[
                      "masked SDPA" if f is decode_masked_sdpa else "per-sequence SDPA"][0])
print(f"decoding with: {DECODE_ATTN.__name__}")

# %%
# Greedy generation, checked at every step
# ----------------------------------------
# ``generate`` runs the prefill, takes the logits of each prompt's last
# token, and then loops: pick the greedy token, feed the ``B`` new tokens as
# one packed batch of length ``B`` at positions ``lengths``, get ``B`` rows of
# logits. With ``use_cache=False`` every step instead recomputes the whole
# ragged batch of prompts plus generated tokens from scratch.
#
# With ``check=True`` each cached step is also recomputed without the cache
# on the same token history, and the last-token logits of every sequence are
# compared with ``torch.testing.assert_close``. Feeding the reference the
# cached run's own tokens keeps both on the same path even if a near-tie
# made an argmax differ in the last bit.

RTOL, ATOL = 1e-4, 1e-4  # float32; measured differences are printed below


@torch.no_grad()
def generate(model, prompts, n_new, use_cache=True, check=False, prefill_attend=None):
    prefill_attend = prefill_attend or attend_per_sequence
    lengths = prompts.offsets().diff()  # (B,)
    B = len(lengths)
    batch = ragged_from_lengths(lengths)
    # token history, padded; int64 bookkeeping only, the model never sees it
    history = torch.zeros(B, int(lengths.max()) + n_new, dtype=torch.long, device=DEVICE)
    history[batch.doc, batch.pos] = prompts.values()
    max_diff = 0.0

    def full_forward(lengths):
        b = ragged_from_lengths(lengths)
        logits = model(history[b.doc, b.pos], b.pos, attend_per_sequence(b))
        return logits[b.offsets[1:] - 1]  # (B, vocab) logits of each last token

    if use_cache:
        cache = KVCache(model.args, B, history.shape[1])
        logits = model(prompts.values(), batch.pos, cache.prefill(batch, prefill_attend))
        last = logits[batch.offsets[1:] - 1]
        cache.advance(lengths)
    else:
        last = full_forward(lengths)

    for step in range(n_new):
        token = last.argmax(-1)  # (B,)
        history[torch.arange(B, device=DEVICE), lengths] = token
        lengths = lengths + 1
        if step == n_new - 1:
            break
        if use_cache:
            last = model(token, cache.lengths, cache.decode(DECODE_ATTN))  # (B, vocab)
            cache.advance()
            if check:
                ref = full_forward(lengths)
                torch.testing.assert_close(last, ref, rtol=RTOL, atol=ATOL)
                max_diff = max(max_diff, (last - ref).abs().max().item())
        else:
            last = full_forward(lengths)
    return history, lengths, max_diff


history, final_lengths, max_diff = generate(mha_model, prompts, N_NEW, check=True)
history_nc, _, _ = generate(mha_model, prompts, N_NEW, use_cache=False)
print(f"{N_NEW - 1} decoding steps x {BATCH} sequences: cached logits match recomputation, "
      f"max |difference| {max_diff:.2e} (rtol={RTOL}, atol={ATOL})")
same = (history == history_nc).all().item()
print(f"greedy tokens identical with and without the cache: {same}")
print("first sequence, generated ids:",
      history[0, int(prompt_lengths[0]):int(final_lengths[0])].tolist()[:16], "...")

# %%
# Tokens per second, with and without the cache
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A single generation is too noisy to time once. Each figure below is the
# median over ``REPEATS`` full generation runs (prefill plus all steps) of
# ``B * n_new`` tokens each, after one warm-up run, with the IQR across runs
# turned into a spread in tokens/s. Without the cache,
# step ``t`` processes every prompt token again plus ``t`` tokens per
# sequence, so its throughput falls as the output grows; with the cache each
# step processes ``B`` tokens and only the attention grows. Beside each
# speedup is the ratio of tokens the two runs push through the model. It
# bounds what the cache saves in the projections and the feed-forward
# layers, the bulk of the arithmetic; the two runs' fixed costs per step
# differ as well (one batched attention call against ``B`` calls per layer),
# so on a small model the measured figure can land on either side of it.


def tokens_per_second(model, n_new, use_cache):
    run = lambda: generate(model, prompts, n_new, use_cache=use_cache)
    run()  # warm-up
    timer = benchmark.Timer("run()", globals={"run": run}, num_threads=torch.get_num_threads())
    runs = [timer.timeit(number=1).median for _ in range(REPEATS)]  # seconds per run
    med = float(np.median(runs))
    iqr = float(np.subtract(*np.percentile(runs, [75, 25])))
    tokens = BATCH * n_new
    return tokens / med, tokens * iqr / med**2  # tokens/s and its spread (from the IQR)


def work_ratio(n_new):
    # tokens pushed through the model: n_new full passes without the cache,
    # one prefill plus n_new - 1 single-token steps with it
    P = int(prompt_lengths.sum())
    no_cache = n_new * P + BATCH * n_new * (n_new - 1) // 2
    return no_cache / (P + BATCH * (n_new - 1))


throughput = {"cache": [], "no cache": []}
for n_new in GEN_LENGTHS:
    for name, use_cache in (("cache", True), ("no cache", False)):
        throughput[name].append(tokens_per_second(mha_model, n_new, use_cache))
    (tc, sc), (tn, sn) = throughput["cache"][-1], throughput["no cache"][-1]
    print(f"{n_new:4d} new tokens: {tc:7.0f} tokens/s (spread {sc:.0f}) with cache, "
          f"{tn:7.0f} (spread {sn:.0f}) without: "
          f"{tc / tn:4.1f}x (bound from tokens processed: {work_ratio(n_new):.1f}x)")

# %%
# Cache memory: allocated and used
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The cache's size is read from its buffers, ``k.nbytes + v.nbytes``, and
# equals ``2 * n_layers * B * Hkv * S_max * head_dim * 4`` bytes in float32,
# with ``S_max`` the longest prompt plus ``n_new``. Of its ``B * S_max``
# token slots, ``sum(lengths)`` hold data: few right after the prefill, more
# at each step. A packed cache would allocate ``sum(prompt + n_new)`` slots,
# which the last step fills exactly.


def cache_report(args: ModelArgs, name: str):
    s_max = int(prompt_lengths.max()) + N_NEW  # what ``generate`` allocates
    c = KVCache(args, BATCH, s_max)
    per_slot = c.nbytes() / (BATCH * s_max)  # bytes per token slot, all layers, k and v
    used = per_slot * (int(prompt_lengths.sum()) + BATCH * np.arange(N_NEW + 1))  # per step
    packed = per_slot * int((prompt_lengths + N_NEW).sum())
    print(f"{name}: padded cache {c.nbytes() / 1e6:.2f} MB allocated; used "
          f"{used[0] / 1e6:.2f} MB after the prefill ({used[0] / c.nbytes():.0%}), "
          f"{used[-1] / 1e6:.2f} MB at the end ({used[-1] / c.nbytes():.0%}); "
          f"a packed cache would allocate {packed / 1e6:.2f} MB")
    return c.nbytes(), used, packed


mha_memory = cache_report(MHA_ARGS, "MHA")

# %%
# Grouped-query attention
# -----------------------
# In grouped-query attention the ``H`` query heads are split into ``Hkv``
# groups that share one key head and one value head. The projections of
# ``k`` and ``v`` shrink by ``H / Hkv``, and so does the cache, which is what
# bounds batch size and context length in serving. The model above already
# supports it: ``wqkv`` produces ``Hkv`` key and value heads, and every
# attention call passes ``enable_gqa=True``.
#
# First the kernels on their own, against a reference that makes the
# sharing explicit by repeating each key/value head ``H / Hkv`` times with
# ``repeat_interleave`` (head ``h`` uses key head ``h // (H / Hkv)``).

group = GQA_ARGS.n_heads // GQA_ARGS.n_kv_heads
H, Hkv, D = GQA_ARGS.n_heads, GQA_ARGS.n_kv_heads, GQA_ARGS.head_dim
T = int(prompt_batch.offsets[-1])
torch.manual_seed(SEED)
q = torch.randn(T, H, D, device=DEVICE)
k = torch.randn(T, Hkv, D, device=DEVICE)
v = torch.randn(T, Hkv, D, device=DEVICE)
k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

reference = attend_per_sequence(prompt_batch)(0, q, k_rep, v_rep)  # (T, H, D), plain MHA

# dense SDPA, one sequence at a time, with ``enable_gqa=True``
sdpa_gqa = attend_per_sequence(prompt_batch)(0, q, k, v)
torch.testing.assert_close(sdpa_gqa, reference)
print(f"SDPA enable_gqa=True vs repeated heads: max |difference| "
      f"{(sdpa_gqa - reference).abs().max().item():.1e}")

# %%
# The jagged SDPA does not take the GQA route: with nested inputs and
# ``enable_gqa=True`` it fails inside a batched ``matmul`` that cannot
# broadcast nested batch dimensions. The call is tried here so that the page
# notices when a future release fixes it.

def as_njt(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # packed (T, heads, D) -> nested (B, heads, j1, D), a view of the same memory
    return torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2)


try:
    F.scaled_dot_product_attention(as_njt(q, prompt_batch.offsets), as_njt(k, prompt_batch.offsets),
                                   as_njt(v, prompt_batch.offsets), enable_gqa=True)
    print("SDPA on nested tensors with enable_gqa=True: runs in this build")
except RuntimeError as err:
    print(f"SDPA on nested tensors with enable_gqa=True: {type(err).__name__}: "
          f"{str(err).splitlines()[0][:90]}...")

# %%
# FlexAttention on the packed batch
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# FlexAttention takes the whole packed batch at once, laid out as one
# "sequence" of ``T`` tokens, ``(1, H, T, D)``, with a *document-causal*
# mask: query ``i`` may see key ``j`` only when both belong to the same
# prompt and ``j <= i``. ``create_block_mask`` evaluates the mask over the
# ``T x T`` grid once and records, for each 128 x 128 block, whether it is
# empty, full or partial; the compiled kernel skips the empty blocks, so the
# cross-sequence part of the square costs almost nothing. The mask depends only on the offsets, so one
# ``BlockMask`` serves every layer. It runs forward only here: FlexAttention
# has no backward on CPU, which is fine for inference.


def document_causal_block_mask(batch: Ragged):
    doc = batch.doc

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    T = len(doc)
    return create_block_mask(document_causal, None, None, T, T, device=DEVICE)


def attend_flex(batch: Ragged):
    block_mask = document_causal_block_mask(batch)

    def attend(layer, q, k, v):
        # (T, heads, D) -> (1, heads, T, D), the packed layout FlexAttention wants
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = flex(q, k, v, block_mask=block_mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)  # (T, H, D)

    return attend


t0 = time.perf_counter()
flex_gqa = attend_flex(prompt_batch)(0, q, k, v)
flex_prefill_compile_s = time.perf_counter() - t0
torch.testing.assert_close(flex_gqa, reference)
print(f"FlexAttention enable_gqa=True, document-causal, vs repeated heads: max |difference| "
      f"{(flex_gqa - reference).abs().max().item():.1e} "
      f"(compile and block mask {flex_prefill_compile_s:.1f} s)")

# %%
# The same attention inside the model: a prefill with ``attend_flex`` and one
# with the per-sequence loop must give the same logits for all ``T`` prompt
# tokens, and the prefill times are compared here.

torch.manual_seed(SEED)
gqa_model = GPT(GQA_ARGS).to(DEVICE).eval()
tokens, pos = prompts.values(), prompt_batch.pos

with torch.no_grad():
    flex_attend = attend_flex(prompt_batch)  # block mask built once, outside the timing
    loop_attend = attend_per_sequence(prompt_batch)
    logits_flex = gqa_model(tokens, pos, flex_attend)
    logits_loop = gqa_model(tokens, pos, loop_attend)
    torch.testing.assert_close(logits_flex, logits_loop, rtol=RTOL, atol=ATOL)
    prefill_flex = timeit(lambda: gqa_model(tokens, pos, flex_attend))
    prefill_loop = timeit(lambda: gqa_model(tokens, pos, loop_attend))
print(f"GQA prefill of {T} tokens: FlexAttention {prefill_flex[0] * 1e3:.2f} ms "
      f"(IQR {prefill_flex[1] * 1e3:.2f}), per-sequence SDPA {prefill_loop[0] * 1e3:.2f} ms "
      f"(IQR {prefill_loop[1] * 1e3:.2f}); logits max |difference| "
      f"{(logits_flex - logits_loop).abs().max().item():.1e}")

# %%
# Decoding with the GQA model
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The GQA model generates with the same cache code, now holding ``Hkv``
# heads, and passes the same step-by-step check against recomputation. Its
# prefill uses FlexAttention this time.

history_gqa, _, max_diff_gqa = generate(gqa_model, prompts, N_NEW, check=True,
                                        prefill_attend=attend_flex)
print(f"GQA: cached logits match recomputation at all {N_NEW - 1} decoding steps, "
      f"max |difference| {max_diff_gqa:.2e}")

gqa_memory = cache_report(GQA_ARGS, "GQA")
print(f"cache memory MHA / GQA: {mha_memory[0] / gqa_memory[0]:.1f}x "
      f"(H / Hkv = {MHA_ARGS.n_heads} / {GQA_ARGS.n_kv_heads} = {group}x)")

n_new = GEN_LENGTHS[-1]
gqa_tps = tokens_per_second(gqa_model, n_new, use_cache=True)
mha_tps = tokens_per_second(mha_model, n_new, use_cache=True)
print(f"decode, {n_new} new tokens with cache: MHA {mha_tps[0]:.0f} tokens/s "
      f"(spread {mha_tps[1]:.0f}), GQA {gqa_tps[0]:.0f} tokens/s (spread {gqa_tps[1]:.0f}); "
      f"GQA / MHA: {gqa_tps[0] / mha_tps[0]:.2f}x")

# %%
# The memory ratio is exact by construction. The speed ratio is a
# measurement: GQA does less work in two places, the key/value projection
# (``wqkv`` is ``(H + 2 Hkv) / 3H`` of its MHA size) and the cache reads of
# every decoding step. On a GPU at large batch, decoding is bound by reading
# the cache from memory, and the second effect dominates; in this small CPU
# model both are modest next to the per-step overheads, so expect the
# printed ratio to move from run to run.
#
# The figure shows both results: throughput against the number of generated
# tokens, and the cache's memory during generation for both models, allocated
# (padded and packed layouts) and used.

import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
for name, style in (("cache", "o-"), ("no cache", "s--")):
    tps = [t for t, _ in throughput[name]]
    err = [e / 2 for _, e in throughput[name]]
    ax1.errorbar(GEN_LENGTHS, tps, yerr=err, fmt=style, capsize=3, label=f"MHA, {name}")
ax1.plot([n_new], [gqa_tps[0]], "^", color="C2", label="GQA, cache")
ax1.set(xlabel="generated tokens per sequence", ylabel="tokens/s (median)",
        title=f"Greedy decoding, batch of {BATCH}, {DEVICE}")
ax1.legend()

steps = np.arange(N_NEW + 1)
for color, (name, (padded, used, packed)) in zip(
        ("C0", "C3"), (("MHA", mha_memory), ("GQA", gqa_memory))):
    ax2.plot(steps, used / 1e6, "-", color=color, label=f"{name}, used")
    ax2.axhline(padded / 1e6, color=color, ls="--", label=f"{name}, allocated (padded)")
    ax2.axhline(packed / 1e6, color=color, ls=":", label=f"{name}, allocated (packed)")
ax2.set(xlabel="decoding step", ylabel="KV cache (MB)", ylim=(0, None),
        title=f"Cache memory, {ARGS.n_layers} layers, float32")
ax2.legend(fontsize="small")
plt.show()

# %%
# varlen attention
# ----------------
# ``torch.nn.attention.varlen.varlen_attn`` is the attention PyTorch now
# recommends for packed ragged batches. It takes packed ``(T, H, D)``
# queries, keys and values, the cumulative sequence lengths of queries and
# keys (``cu_seq_q``, ``cu_seq_k``: exactly the ``offsets()`` of an NJT, as
# ``int32``), and the longest query and key lengths. In 2.13 it has no
# ``is_causal`` argument: causal attention is ``window_size=(-1, 0)``, and
# ``(-1, -1)`` is full attention within each sequence. It calls the Flash
# Attention kernel, so it needs CUDA and ``float16`` or ``bfloat16``; its keyword
# arguments on the installed build are:

import inspect

if varlen_attn is not None:
    print(inspect.signature(varlen_attn))
else:
    print("varlen_attn is not available in this torch build")

# %%
# The comparison: the same packed ``q``, ``k``, ``v`` through three paths,
# with attention confined to each sequence (no causal mask, so SDPA on a
# nested tensor, which is non-causal only on CPU, can take part).
#
# * SDPA on NJT inputs, ``(B, H, j1, D)`` after the usual transpose.
# * FlexAttention with a *document* mask, ``doc[q] == doc[k]``.
# * ``varlen_attn`` with ``cu_seq_q = cu_seq_k = offsets``, on CUDA.
#
# On CUDA the three run in ``HALF`` and are compared at half-precision
# tolerances; on CPU they run in float32 and ``varlen_attn`` is skipped, with
# FlexAttention standing in for it. The causal case is checked too, against
# the per-sequence loop, for FlexAttention and ``varlen_attn``.

vl_lengths = zipf_lengths(rng, VARLEN_BATCH, 1, VARLEN_MAX)
vl = ragged_from_lengths(vl_lengths)
VL_DTYPE = HALF if HAS_VARLEN else DTYPE
T_vl, H_vl, D_vl = int(vl.offsets[-1]), 16 if DEVICE == "cuda" else 8, 64 if DEVICE == "cuda" else 16
torch.manual_seed(SEED)
qv, kv_, vv = (torch.randn(T_vl, H_vl, D_vl, device=DEVICE, dtype=VL_DTYPE) for _ in range(3))
tol = dict(rtol=2e-2, atol=2e-2) if VL_DTYPE != torch.float32 else dict(rtol=1e-5, atol=1e-5)
print(f"{VARLEN_BATCH} sequences, {T_vl} tokens, longest {int(vl_lengths.max())}; "
      f"{H_vl} heads of {D_vl}, {VL_DTYPE}")


def sdpa_njt(q, k, v):
    q, k, v = (as_njt(x, vl.offsets) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)  # (B, H, j1, D)
    return out.transpose(1, 2).values()  # (T, H, D)


def document_block_mask(batch: Ragged, causal: bool):
    doc = batch.doc

    def document(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    return create_block_mask(document, None, None, len(doc), len(doc), device=DEVICE)


def flex_packed(q, k, v, block_mask):
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, T, D)
    return flex(q, k, v, block_mask=block_mask).squeeze(0).transpose(0, 1)


doc_mask = document_block_mask(vl, causal=False)
doc_causal_mask = document_block_mask(vl, causal=True)
paths = {
    "SDPA on NJT": lambda: sdpa_njt(qv, kv_, vv),
    "FlexAttention, document mask": lambda: flex_packed(qv, kv_, vv, doc_mask),
}
if HAS_VARLEN:
    cu_seq = vl.offsets.to(torch.int32)  # (B + 1,)
    max_len = int(vl_lengths.max())
    paths["varlen_attn"] = lambda: varlen_attn(qv, kv_, vv, cu_seq, cu_seq, max_len, max_len)

with torch.no_grad():
    outputs = {name: fn() for name, fn in paths.items()}
    base = outputs["SDPA on NJT"]
    for name, out in list(outputs.items())[1:]:
        torch.testing.assert_close(out, base, **tol)
        print(f"  {name:30s} max |difference| to SDPA on NJT: "
              f"{(out - base).abs().max().item():.1e}")

    # causal: the per-sequence loop is the reference
    causal_ref = attend_per_sequence(vl)(0, qv, kv_, vv)
    causal_flex = flex_packed(qv, kv_, vv, doc_causal_mask)
    torch.testing.assert_close(causal_flex, causal_ref, **tol)
    causal_paths = {"FlexAttention, document-causal": causal_flex}
    if HAS_VARLEN:
        causal_paths["varlen_attn, window_size=(-1, 0)"] = varlen_attn(
            qv, kv_, vv, cu_seq, cu_seq, max_len, max_len, window_size=(-1, 0))
        torch.testing.assert_close(causal_paths["varlen_attn, window_size=(-1, 0)"],
                                   causal_ref, **tol)
    for name, out in causal_paths.items():
        print(f"  {name:30s} max |difference| to the causal loop: "
              f"{(out - causal_ref).abs().max().item():.1e}")

ran = "varlen_attn (CUDA)" if HAS_VARLEN else "FlexAttention in place of varlen_attn"
print(f"path that ran for varlen attention: {ran}")

# %%
# And their speed, measured the same way. On CPU only the first two exist;
# on CUDA all three run on the same inputs.

with torch.no_grad():
    for name, fn in paths.items():
        med, iqr = timeit(fn)
        print(f"  {name:30s} {med * 1e3:8.3f} ms (IQR {iqr * 1e3:.3f})")

# %%
# Conclusion
# ----------
# The three sections the building blocks tutorial left pending all work in
# PyTorch 2.13, though not on nested tensors as planned:
#
# * A **KV cache** for a ragged batch is easiest as a preallocated padded
#   buffer with a length per sequence, written by advanced indexing and read
#   with one masked SDPA call. In the one-layer timing above, the
#   FlexAttention kernel alone can match or beat it; only once the block
#   mask that FlexAttention has to rebuild at every step is counted is the
#   masked call the fastest way to attend during decoding on this CPU (the
#   ranking is printed above). It matched a full recomputation, to about
#   ``1e-6``, at every step of every sequence. Its price is memory spent on
#   padding, printed above; a packed cache with per-sequence capacity avoids
#   it, and on CUDA ``varlen_attn`` is documented to read such a cache
#   directly, with the slot starts as ``cu_seq_k`` and ``seqused_k=lengths``.
# * **GQA** is one flag, ``enable_gqa=True``, on dense SDPA and on
#   FlexAttention, and it divides the cache by ``H / Hkv``. It does not work
#   on nested tensors.
# * **Packed attention** over the whole ragged batch is FlexAttention with a
#   document mask built from the offsets on any device, and ``varlen_attn``
#   with the same offsets on CUDA. On a CPU with two cores, a plain loop of
#   per-sequence SDPA calls prefilled about as fast as FlexAttention and
#   needs no compiler: measure before choosing. The nested tensor stays a
#   convenient container for the offsets.
#
# References
# ----------
# * Transformer building blocks tutorial:
#   https://pytorch.org/tutorials/intermediate/transformer_building_blocks.html
# * ``varlen_attn``: https://docs.pytorch.org/docs/stable/nn.attention.varlen.html
# * FlexAttention blog post: https://pytorch.org/blog/flexattention/
# * Attention Gym, document masking examples:
#   https://github.com/pytorch-labs/attention-gym
# * ``gpt-fast``, a simple KV-cache decoder: https://github.com/pytorch-labs/gpt-fast
# * "GQA: Training Generalized Multi-Query Transformer Models from
#   Multi-Head Checkpoints", 2023: https://arxiv.org/abs/2305.13245
# * "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021: https://arxiv.org/abs/2104.09864

# sphinx_gallery_thumbnail_number = 1
