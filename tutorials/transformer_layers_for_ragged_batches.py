"""
Transformer layers for ragged batches, in parity with ``torch.nn``
==================================================================

Every layer of the ``nn.Transformer`` family rebuilt for batches of
sequences of different lengths, proven equal to ``torch.nn``, measured, and
trained end to end.

**Author:** the tutorials team

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How to write every layer of the ``nn.Transformer`` family so that it
         takes a ragged batch (sequences of different lengths, no padding)
         instead of a padded batch and a set of ``*_padding_mask`` arguments
       * Which attention implementation runs on which device in PyTorch 2.13,
         and why
       * How to prove, weight for weight and gradient for gradient, that the
         ragged layers compute what ``torch.nn`` computes
       * What skipping the padding buys in time and memory, measured against
         the bound the padding itself sets, and that the ragged model trains

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.11 or later (checked on 2.11 and 2.13 on CPU; the CUDA
         branch is written for those versions but was not run for this build)
       * No GPU needed; on a CUDA machine the page picks larger sizes and the
         fused attention kernels

A batch of sentences is ragged: one has 4 tokens, the next 60. The
``torch.nn`` transformer layers want a rectangle, so the usual recipe pads
every sequence to the longest one and hands each layer a padding mask that
says which positions to ignore. The layers then spend time and memory on the
padding, and every caller has to thread three kinds of masks through them
correctly.

This page rebuilds ``nn.TransformerEncoderLayer``,
``nn.TransformerEncoder``, ``nn.TransformerDecoderLayer``,
``nn.TransformerDecoder`` and ``nn.Transformer`` for ragged batches, on top of
a small multi-head attention layer written here. None of them has a padding
mask argument. We then check each one against its ``torch.nn`` twin, time the
two, and train both on the same toy task.
"""

# sphinx_gallery_tags = ["nn.Transformer", "parity", "training", "benchmarks"]

# %%
# Setup
# -----
# The page needs a recent PyTorch; it stops here with a plain message
# otherwise, rather than failing halfway down with a stack trace.
#
# Compiling nested-tensor code prints a few warnings that say nothing about
# your code, and ``torch.nested.nested_tensor_from_jagged`` logs a notice about
# ``torch.fx`` tracing the first time it is called. We silence exactly those,
# by their message, and leave every other warning visible.

import logging
import os
import warnings

import torch

_major, _minor = (int(p) for p in torch.__version__.split(".")[:2])
if (_major, _minor) < (2, 11):
    raise RuntimeError(
        f"This tutorial needs PyTorch 2.11 or later (checked on 2.11 and 2.13); "
        f"found {torch.__version__}."
    )
for _feature in ("torch.backends.mha.set_fastpath_enabled", "torch.compiler.disable",
                 "torch.nested.nested_tensor_from_jagged"):
    _obj = torch
    for _part in _feature.split(".")[1:]:
        _obj = getattr(_obj, _part, None)
    if _obj is None:
        raise RuntimeError(f"This tutorial needs {_feature}, which this PyTorch "
                           f"({torch.__version__}) does not have.")

warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
warnings.filterwarnings("ignore", message=".*prototype stage.*")


class _DropPickleCacheKey(logging.Filter):
    """Drops the inductor cache's "Failed to pickle cache key" record only."""

    def filter(self, record):
        return "Failed to pickle cache key" not in record.getMessage()


logging.getLogger("torch._inductor.codecache").addFilter(_DropPickleCacheKey())


class _DropFxTracingNotice(logging.Filter):
    """Drops the notice that ``nested_tensor_from_jagged`` logs on first use."""

    def filter(self, record):
        return "is_fx_tracing will return true" not in record.getMessage()


logging.getLogger("torch.fx._symbolic_trace").addFilter(_DropFxTracingNotice())

# %%
# Device and sizes
# ~~~~~~~~~~~~~~~~
# Every size on the page is chosen here. The CPU sizes are small so that the
# whole page runs in a few minutes on two cores; the CUDA sizes are closer to
# a real model (``nn.Transformer``'s defaults are ``d_model=512``, 8 heads,
# 6 + 6 layers, ``dim_feedforward=2048``). ``TUTORIALS_QUICK=1`` shrinks
# everything again for the test suite; every assertion still runs.

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUICK = os.environ.get("TUTORIALS_QUICK", "0") == "1"
SEED = 0

if DEVICE == "cuda":
    # benchmark: batch, model width, heads, feed-forward width, layers
    BENCH = dict(batch=256, d_model=512, nhead=8, dim_ff=2048, layers=6)
    TRAIN = dict(batch=128, d_model=256, nhead=8, dim_ff=1024, layers=3,
                 steps=600, lr=1e-3, max_len=48)
else:
    BENCH = dict(batch=64, d_model=128, nhead=4, dim_ff=512, layers=2)
    TRAIN = dict(batch=32, d_model=64, nhead=4, dim_ff=256, layers=2,
                 steps=300, lr=2e-3, max_len=16)
if QUICK:
    BENCH.update(batch=16, d_model=64, nhead=4, dim_ff=128, layers=1)
    TRAIN.update(steps=100, batch=24, lr=3e-3)
MIN_RUN_TIME = 0.2 if QUICK else 0.5  # seconds per timing (``blocked_autorange``)

torch.manual_seed(SEED)
torch.backends.mha.set_fastpath_enabled(False)  # see "Proof of parity" below
print(f"DEVICE = {DEVICE}, QUICK = {QUICK}, torch {torch.__version__}")
print(f"benchmark sizes: {BENCH}")
print(f"training sizes:  {TRAIN}")

# %%
# A ragged batch is packed values plus offsets
# --------------------------------------------
# A nested tensor with the ``torch.jagged`` layout (NJT) stores a ragged batch
# as one dense ``values()`` tensor of shape ``(total_tokens, E)``, all
# sequences back to back, plus ``offsets()``, the ``B + 1`` positions where
# each sequence starts and the last one ends (``cu_seqlens`` in FlashAttention
# terms).
#
# Between attention layers, a transformer only does per-token work: linear
# layers, layer norm, dropout, residual additions. On packed values those are
# ordinary dense ops on a ``(total_tokens, E)`` tensor, and only attention has
# to know where one sequence ends and the next begins. So the layers below
# take packed values and offsets, not an NJT. This keeps everything outside
# attention a plain dense tensor that ``torch.compile`` handles without the
# nested-tensor subclass, and it is the layout that
# ``torch.nn.attention.varlen.varlen_attn`` and FlexAttention document masks
# also take. An NJT converts both ways for free: ``nt.values()`` and
# ``nt.offsets()`` in, ``torch.nested.nested_tensor_from_jagged(values,
# offsets)`` out.
#
# A word of caution on NJT itself: PyTorch's nested-tensor documentation now
# says nested tensors are not under active development, and the maintainers
# point to packed sequences with varlen or document-masked attention instead.
# Packed values plus offsets is that layout, with or without NJT around it.
#
# The sequence lengths follow the generator of the original
# building-blocks tutorial: draw words from a Zipf distribution until one of
# three "end of sentence" ranks comes up. Here it draws from a seeded
# ``numpy.random.Generator``, so every figure on the page is reproducible.

import numpy as np


def sentence_lengths(rng, batch, alpha=1.2, max_len=None):
    """Lengths of ``batch`` sentences whose words are Zipf(``alpha``) ranks."""
    stops = (3, 386, 858)  # ranks of ".", "!" and "?" in wikitext-2
    lengths = []
    for _ in range(batch):
        n = 1
        while rng.zipf(alpha) not in stops:
            n += 1
        lengths.append(n if max_len is None else min(n, max_len))
    return lengths


def offsets_from_lengths(lengths, device=DEVICE):
    lengths = torch.as_tensor(lengths, device=device)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])  # (B + 1,)


def token_index(offsets):
    """For every packed token: its sequence id and its position within it."""
    lengths = offsets.diff()  # (B,)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=offsets.device), lengths)
    pos = torch.arange(len(seq), device=offsets.device) - offsets[seq]
    return seq, pos  # (T,), (T,)


def to_padded(values, offsets, pad_value=0.0):
    """Packed ``(T, ...)`` to padded ``(B, S, ...)`` plus a ``(B, S)`` pad mask."""
    seq, pos = token_index(offsets)
    B, S = len(offsets) - 1, int(offsets.diff().max())
    padded = values.new_full((B, S, *values.shape[1:]), pad_value)
    padded[seq, pos] = values
    is_pad = torch.ones(B, S, dtype=torch.bool, device=values.device)
    is_pad[seq, pos] = False  # True where nn must ignore the position
    return padded, is_pad


def from_padded(padded, offsets):
    """Padded ``(B, S, ...)`` back to packed ``(T, ...)``: valid positions only."""
    seq, pos = token_index(offsets)
    return padded[seq, pos]


rng = np.random.default_rng(SEED)
lengths = sentence_lengths(rng, 8)
nt = torch.nested.nested_tensor(
    [torch.randn(n, 4) for n in lengths], layout=torch.jagged, device=DEVICE
)
print("lengths:", lengths)
print(f"values: {tuple(nt.values().shape)}, offsets: {nt.offsets().tolist()}")
padded, is_pad = to_padded(nt.values(), nt.offsets())
print(f"padded shape: {tuple(padded.shape)}, "
      f"{is_pad.float().mean().item():.0%} of it is padding")

# %%
# Attention over a ragged batch: what runs where
# ----------------------------------------------
# Attention is the one layer that has to respect sequence boundaries. In
# PyTorch 2.13 the candidates behave like this:
#
# .. list-table::
#    :header-rows: 1
#    :widths: 40 30 30
#
#    * - implementation
#      - CPU
#      - CUDA
#    * - ``F.scaled_dot_product_attention`` (SDPA) on NJT inputs
#      - only the math path: no ``is_causal=True``, inputs must be contiguous
#        after the head transpose, loops over sequences internally
#      - fused FlashAttention / memory-efficient kernels, ``is_causal``
#        supported, forward and backward
#    * - FlexAttention with a document mask over packed values
#      - forward only: no backward on CPU
#      - forward and backward, compiled
#    * - ``varlen_attn`` on packed values
#      - not available (no CPU kernel)
#      - FlashAttention varlen kernel
#    * - a loop of dense SDPA calls, one per sequence, over the offsets
#      - forward and backward, causal or not, uses the CPU flash kernel
#      - works, but launches ``B`` small kernels per layer
#
# So the layers below call one function, ``ragged_attention``, that picks by
# device: on CUDA it wraps the packed query, key and value into NJTs and calls
# SDPA, which dispatches to a fused kernel; on CPU it loops over the sequences
# and calls dense SDPA on each slice. Both run eagerly even inside a
# compiled model (``torch.compiler.disable``). The loop's Python-level
# slicing depends on the offsets' values, which ``torch.compile`` would
# otherwise specialize on, compiling a new graph for every batch. The NJT
# path computes the shortest and longest sequence lengths from the offsets
# (SDPA checks the first for empty sequences and passes the second to the
# fused kernel) and reads them back to the host, which in a compiled graph
# would be a graph break anyway; run eagerly, it is one host read per call.

import torch.nn.functional as F

ATTENTION_PATH = "nested" if DEVICE == "cuda" else "loop"


def ragged_attention(q, k, v, q_offsets, kv_offsets, is_causal=False, dropout_p=0.0):
    """Attention within each sequence of a packed batch.

    ``q``: ``(T_q, H, D)``, ``k`` and ``v``: ``(T_kv, H, D)``; sequence ``i``
    of ``q`` attends to sequence ``i`` of ``k`` and ``v``. Returns ``(T_q, H, D)``.
    """
    if ATTENTION_PATH == "nested":
        return _nested_attention(q, k, v, q_offsets, kv_offsets, is_causal, dropout_p)
    return _looped_attention(q, k, v, q_offsets, kv_offsets, is_causal, dropout_p)


@torch.compiler.disable
def _nested_attention(q, k, v, q_offsets, kv_offsets, is_causal, dropout_p):
    njt = torch.nested.nested_tensor_from_jagged
    # (T, H, D) -> NJT (B, j, H, D) -> (B, H, j, D)
    q = njt(q.contiguous(), q_offsets).transpose(1, 2)
    k = njt(k.contiguous(), kv_offsets).transpose(1, 2)
    v = njt(v.contiguous(), kv_offsets).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal)
    return out.transpose(1, 2).values()  # (T_q, H, D)


@torch.compiler.disable
def _looped_attention(q, k, v, q_offsets, kv_offsets, is_causal, dropout_p):
    q_len, kv_len = q_offsets.diff().tolist(), kv_offsets.diff().tolist()
    out = []
    # ``split`` rather than slicing: its backward is one concatenation, while
    # each slice's backward would write a zero tensor the size of the batch.
    # The CPU flash kernel wants 4-D inputs; 3-D ones fall back to the math path.
    for qi, ki, vi in zip(q.split(q_len), k.split(kv_len), v.split(kv_len)):
        oi = F.scaled_dot_product_attention(
            qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None],
            dropout_p=dropout_p, is_causal=is_causal,
        )  # (1, H, L_q, D)
        out.append(oi[0].transpose(0, 1))  # (L_q, H, D)
    return torch.cat(out)  # (T_q, H, D)


# %%
# Multi-head attention
# --------------------
# The attention layer projects its inputs, splits the heads, attends within
# each sequence and projects back. For self-attention, query, key and value
# come from one input, so one packed ``Linear(E, 3E)`` computes all three in a
# single matrix multiply; for cross-attention the query comes from the decoder
# and key and value from the encoder, so they get separate projections.
# Dropout on the attention weights is applied only in training mode.

import torch.nn as nn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, nhead, dropout=0.0, bias=True, self_attention=True):
        super().__init__()
        assert d_model % nhead == 0, "d_model must be divisible by nhead"
        self.nhead, self.dropout = nhead, dropout
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        else:
            self.q_proj = nn.Linear(d_model, d_model, bias=bias)
            self.k_proj = nn.Linear(d_model, d_model, bias=bias)
            self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x, offsets, memory=None, memory_offsets=None, is_causal=False):
        T, E = x.shape  # x: (T, E), packed
        H, D = self.nhead, E // self.nhead
        if memory is None:  # self-attention
            q, k, v = self.qkv_proj(x).view(T, 3, H, D).unbind(1)  # 3 x (T, H, D)
            memory_offsets = offsets
        else:  # cross-attention, memory: (T_mem, E)
            q = self.q_proj(x).view(T, H, D)
            k = self.k_proj(memory).view(-1, H, D)  # (T_mem, H, D)
            v = self.v_proj(memory).view(-1, H, D)
        p = self.dropout if self.training else 0.0
        out = ragged_attention(q, k, v, offsets, memory_offsets, is_causal, p)
        return self.out_proj(out.reshape(T, E))  # (T, E)


# %%
# The encoder and decoder layers
# ------------------------------
# The layers follow ``torch.nn`` line for line, with the same submodule names
# (so weights load by name), the same defaults (``norm_first=False``,
# ``dropout=0.1``, ReLU), ``norm_first`` both ways, ReLU or GELU, ``bias``
# on every linear and layer-norm, and dropout after attention, inside and
# after the feed-forward block. What changes is the signature: a packed
# ``(T, E)`` tensor plus offsets instead of a padded ``(B, S, E)`` tensor plus
# masks.

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1,
                 activation="relu", layer_norm_eps=1e-5, norm_first=False, bias=True):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, nhead, dropout, bias)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)  # inside the feed-forward block
        self.dropout1 = nn.Dropout(dropout)  # after attention
        self.dropout2 = nn.Dropout(dropout)  # after the feed-forward block
        self.activation = _ACTIVATIONS[activation]
        self.norm_first = norm_first

    def _sa(self, x, offsets, is_causal):
        return self.dropout1(self.self_attn(x, offsets, is_causal=is_causal))

    def _ff(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x, offsets, is_causal=False):  # x: (T, E)
        if self.norm_first:
            x = x + self._sa(self.norm1(x), offsets, is_causal)
            x = x + self._ff(self.norm2(x))
        else:
            x = self.norm1(x + self._sa(x, offsets, is_causal))
            x = self.norm2(x + self._ff(x))
        return x


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1,
                 activation="relu", layer_norm_eps=1e-5, norm_first=False, bias=True):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, nhead, dropout, bias)
        self.multihead_attn = MultiHeadAttention(d_model, nhead, dropout, bias,
                                                 self_attention=False)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.activation = _ACTIVATIONS[activation]
        self.norm_first = norm_first

    def _sa(self, x, offsets, is_causal):
        return self.dropout1(self.self_attn(x, offsets, is_causal=is_causal))

    def _mha(self, x, offsets, mem, mem_offsets):
        return self.dropout2(self.multihead_attn(x, offsets, mem, mem_offsets))

    def _ff(self, x):
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x, offsets, memory, memory_offsets, is_causal=True):
        # x: (T_tgt, E), memory: (T_src, E)
        if self.norm_first:
            x = x + self._sa(self.norm1(x), offsets, is_causal)
            x = x + self._mha(self.norm2(x), offsets, memory, memory_offsets)
            x = x + self._ff(self.norm3(x))
        else:
            x = self.norm1(x + self._sa(x, offsets, is_causal))
            x = self.norm2(x + self._mha(x, offsets, memory, memory_offsets))
            x = self.norm3(x + self._ff(x))
        return x


# %%
# The stacks and the full transformer
# -----------------------------------
# The stacks repeat a layer ``num_layers`` times (as ``torch.nn`` does, by
# copying it) and apply an optional final norm. ``Transformer`` wires an
# encoder stack and a decoder stack together, each with a final layer norm,
# and initializes every matrix with Xavier-uniform, as ``nn.Transformer``
# does.

import copy


class TransformerEncoder(nn.Module):
    def __init__(self, encoder_layer, num_layers, norm=None):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(encoder_layer) for _ in range(num_layers))
        self.norm = norm

    def forward(self, x, offsets, is_causal=False):
        for layer in self.layers:
            x = layer(x, offsets, is_causal)
        return x if self.norm is None else self.norm(x)


class TransformerDecoder(nn.Module):
    def __init__(self, decoder_layer, num_layers, norm=None):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(decoder_layer) for _ in range(num_layers))
        self.norm = norm

    def forward(self, x, offsets, memory, memory_offsets, is_causal=True):
        for layer in self.layers:
            x = layer(x, offsets, memory, memory_offsets, is_causal)
        return x if self.norm is None else self.norm(x)


class Transformer(nn.Module):
    def __init__(self, d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                 dim_feedforward=2048, dropout=0.1, activation="relu",
                 layer_norm_eps=1e-5, norm_first=False, bias=True):
        super().__init__()
        layer_args = (d_model, nhead, dim_feedforward, dropout, activation,
                      layer_norm_eps, norm_first, bias)
        self.encoder = TransformerEncoder(
            TransformerEncoderLayer(*layer_args), num_encoder_layers,
            nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias))
        self.decoder = TransformerDecoder(
            TransformerDecoderLayer(*layer_args), num_decoder_layers,
            nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias))
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, src_offsets, tgt, tgt_offsets, tgt_is_causal=True):
        # src: (T_src, E), tgt: (T_tgt, E) -> (T_tgt, E)
        memory = self.encoder(src, src_offsets)
        return self.decoder(tgt, tgt_offsets, memory, src_offsets, tgt_is_causal)


# %%
# What replaces each ``nn.Transformer`` argument
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# .. list-table::
#    :header-rows: 1
#    :widths: 30 70
#
#    * - ``torch.nn`` argument
#      - for a ragged batch
#    * - ``src_key_padding_mask``, ``tgt_key_padding_mask``,
#        ``memory_key_padding_mask``
#      - gone: ``src_offsets`` and ``tgt_offsets`` say where each sequence
#        ends (the memory has the source's offsets), so there is no padding
#        to mask
#    * - ``tgt_mask`` (causal) with ``tgt_is_causal``
#      - ``tgt_is_causal=True`` (the default for the decoder), causal within
#        each sequence; no mask is built
#    * - ``src_mask`` with ``src_is_causal``
#      - ``is_causal=True`` on ``TransformerEncoder`` or
#        ``TransformerEncoderLayer``, causal within each sequence (a GPT-style
#        stack); ``Transformer`` keeps its encoder non-causal
#    * - ``memory_mask``, ``memory_is_causal``
#      - no ragged meaning here: source and target have different lengths
#        per sequence, so "causal" between them is undefined; an arbitrary
#        per-position mask needs a mask-aware kernel (FlexAttention) and is
#        not supported by these layers
#    * - arbitrary float or boolean ``src_mask`` / ``tgt_mask``
#      - not supported: only "all of my own sequence" or "causal within my
#        own sequence"; the loop and the NJT kernels take no mask
#    * - ``batch_first``
#      - no meaning: a packed batch has no batch dimension, tokens are
#        ``(T, E)`` and the offsets carry the batch
#    * - ``enable_nested_tensor``, ``mask_check`` (``nn.TransformerEncoder``)
#      - no meaning: they steer the ``torch.nn`` fast path, which converts a
#        padded batch to a nested one internally
#    * - ``custom_encoder``, ``custom_decoder``
#      - build ``Transformer`` from your own stacks instead
#    * - ``d_model``, ``nhead``, ``num_encoder_layers``,
#        ``num_decoder_layers``, ``dim_feedforward``, ``dropout``,
#        ``activation`` (``"relu"`` or ``"gelu"``), ``layer_norm_eps``,
#        ``norm_first``, ``bias``
#      - same meaning, same defaults
#    * - ``device``, ``dtype``
#      - use ``.to(device, dtype)`` on the module

# %%
# Proof of parity with ``torch.nn``
# ---------------------------------
# For each layer and stack, in both ``norm_first`` settings, we build the
# ``torch.nn`` module, copy its weights into the ragged one, and run the
# ``torch.nn`` module on the padded batch with the padding masks (and a
# causal mask for the decoder) and the ragged one on the packed batch. Then we
# compare the outputs at every valid position, and the gradient of every
# parameter after a backward pass through a random linear function of those
# outputs. Any mismatch stops the page. Dropout is 0 so that both sides are
# deterministic.
#
# Two details of ``torch.nn`` matter here. First, its outputs at padded
# positions are not zero (they are whatever the layer computes from the pad
# embeddings), so only valid positions are compared, and the backward pass
# starts from the valid positions only. Second, in eval mode
# ``nn.TransformerEncoderLayer`` takes a "fast path" that handles pad
# positions differently (it returns zeros there, and NaN for a sequence that
# is entirely padding). We turned that path off at the top with
# ``torch.backends.mha.set_fastpath_enabled(False)``, so both modes run the
# same math.
#
# Weights load by name. The only names that differ are the attention input
# projections: ``torch.nn`` keeps one ``in_proj_weight`` of shape ``(3E, E)``,
# which is the packed ``qkv_proj`` for self-attention and is split into
# ``q_proj``, ``k_proj`` and ``v_proj`` for cross-attention. The same mapping
# translates the gradients, so a gradient check is a dictionary comparison.


def from_nn_names(tensors):
    """Rename (and split) a ``torch.nn`` state or gradient dict for our layers."""
    out = {}
    for name, t in tensors.items():
        prefix, _, kind = name.rpartition("in_proj_")  # kind: "weight" / "bias"
        if not prefix:
            out[name] = t
        elif prefix.endswith("multihead_attn."):  # cross-attention: split
            for p, chunk in zip("qkv", t.chunk(3)):
                out[f"{prefix}{p}_proj.{kind}"] = chunk
        else:  # self-attention: packed
            out[f"{prefix}qkv_proj.{kind}"] = t
    return out


def load_from_nn(ragged, reference):
    ragged.load_state_dict(from_nn_names(reference.state_dict()), strict=True)
    return ragged


def causal_mask(S, device=DEVICE):
    return torch.ones(S, S, dtype=torch.bool, device=device).triu(1)  # True = masked


def make_nn_transformer(d_model, nhead, num_encoder_layers, num_decoder_layers, **kw):
    """``nn.Transformer``, batch first, its encoder built with
    ``enable_nested_tensor=False`` (that fast path is off on this page anyway,
    and ``nn.Transformer`` warns about it for ``norm_first=True`` or
    ``bias=False``)."""
    layer = nn.TransformerEncoderLayer(d_model, nhead, batch_first=True, **kw)
    norm = nn.LayerNorm(d_model, eps=kw.get("layer_norm_eps", 1e-5), bias=kw.get("bias", True))
    encoder = nn.TransformerEncoder(layer, num_encoder_layers, norm, enable_nested_tensor=False)
    return nn.Transformer(d_model, nhead, num_encoder_layers, num_decoder_layers,
                          custom_encoder=encoder, batch_first=True, **kw)


# %%
# One function runs a pair on the same batch. ``x`` and ``mem`` are packed
# inputs with their offsets; ``mem`` is the decoder's memory (for the full
# transformer, the source). ``run_nn`` and ``run_ragged`` say how to call each
# side.

from torch.testing import assert_close

ATOL, RTOL = 1e-5, 1e-4  # float32; the two sides sum in different orders


def check_parity(name, reference, ragged, run_nn, run_ragged, x, x_off, mem=None, mem_off=None):
    x_pad, x_is_pad = to_padded(x, x_off)
    mem_pad, mem_is_pad = to_padded(mem, mem_off) if mem is not None else (None, None)
    out_nn = from_padded(run_nn(reference, x_pad, x_is_pad, mem_pad, mem_is_pad), x_off)
    out_rg = run_ragged(ragged, x, x_off, mem, mem_off)
    cotangent = torch.randn_like(out_rg)
    (out_nn * cotangent).sum().backward()
    (out_rg * cotangent).sum().backward()
    assert_close(out_rg, out_nn, atol=ATOL, rtol=RTOL)
    grads_nn = from_nn_names({n: p.grad for n, p in reference.named_parameters()})
    grads_rg = {n: p.grad for n, p in ragged.named_parameters()}
    assert grads_nn.keys() == grads_rg.keys()
    for n in grads_rg:
        assert_close(grads_rg[n], grads_nn[n], atol=ATOL, rtol=RTOL,
                     msg=lambda m: f"{name} {n}: {m}")
    out_err = (out_rg - out_nn).abs().max().item()
    grad_err = max((grads_rg[n] - grads_nn[n]).abs().max().item() for n in grads_rg)
    print(f"{name:<50} output {out_err:.1e}  grads {grad_err:.1e}  ({len(grads_rg)} tensors)")


# %%
# The calls: ``torch.nn`` gets masks, the ragged side gets offsets.


def nn_encoder(m, x, is_pad, mem, mem_is_pad):
    return m(x, src_key_padding_mask=is_pad)


def nn_decoder(m, x, is_pad, mem, mem_is_pad):
    S = x.shape[1]
    return m(x, mem, tgt_mask=causal_mask(S), tgt_is_causal=True,
             tgt_key_padding_mask=is_pad, memory_key_padding_mask=mem_is_pad)


def nn_transformer(m, tgt, tgt_is_pad, src, src_is_pad):
    S = tgt.shape[1]
    return m(src, tgt, tgt_mask=causal_mask(S), tgt_is_causal=True,
             src_key_padding_mask=src_is_pad, tgt_key_padding_mask=tgt_is_pad,
             memory_key_padding_mask=src_is_pad)


def rg_encoder(m, x, off, mem, mem_off):
    return m(x, off)


def rg_decoder(m, x, off, mem, mem_off):
    return m(x, off, mem, mem_off)


def rg_transformer(m, tgt, tgt_off, src, src_off):
    return m(src, src_off, tgt, tgt_off)


# %%
# Now every layer and stack, in both ``norm_first`` settings, alternating ReLU
# and GELU and switching the biases off in one case each. The stacks get a
# final layer norm; ``nn.Transformer`` always has both.

E, NHEAD, FF = 32, 4, 64
rng = np.random.default_rng(SEED)
x_off = offsets_from_lengths(sentence_lengths(rng, 6, max_len=40))
m_off = offsets_from_lengths(sentence_lengths(rng, 6, max_len=40))
x = torch.randn(int(x_off[-1]), E, device=DEVICE)
mem = torch.randn(int(m_off[-1]), E, device=DEVICE)
print("target lengths", x_off.diff().tolist(), "memory lengths", m_off.diff().tolist())


def layer_kwargs(norm_first, activation, bias):
    return dict(dim_feedforward=FF, dropout=0.0, activation=activation,
                norm_first=norm_first, bias=bias)


for norm_first in (False, True):
    for activation, bias in (("relu", True), ("gelu", False)):
        kw = layer_kwargs(norm_first, activation, bias)
        tag = f"norm_first={norm_first}, {activation}, bias={bias}"
        nn_kw = dict(kw, batch_first=True)
        pairs = [
            ("EncoderLayer", nn.TransformerEncoderLayer(E, NHEAD, **nn_kw),
             TransformerEncoderLayer(E, NHEAD, **kw), nn_encoder, rg_encoder, False),
            ("Encoder", nn.TransformerEncoder(nn.TransformerEncoderLayer(E, NHEAD, **nn_kw), 2,
                                              nn.LayerNorm(E, bias=bias),
                                              enable_nested_tensor=False),
             TransformerEncoder(TransformerEncoderLayer(E, NHEAD, **kw), 2,
                                nn.LayerNorm(E, bias=bias)),
             nn_encoder, rg_encoder, False),
            ("DecoderLayer", nn.TransformerDecoderLayer(E, NHEAD, **nn_kw),
             TransformerDecoderLayer(E, NHEAD, **kw), nn_decoder, rg_decoder, True),
            ("Decoder", nn.TransformerDecoder(nn.TransformerDecoderLayer(E, NHEAD, **nn_kw), 2,
                                              nn.LayerNorm(E, bias=bias)),
             TransformerDecoder(TransformerDecoderLayer(E, NHEAD, **kw), 2,
                                nn.LayerNorm(E, bias=bias)),
             nn_decoder, rg_decoder, True),
            ("Transformer", make_nn_transformer(E, NHEAD, 2, 2, **kw),
             Transformer(E, NHEAD, 2, 2, **kw), nn_transformer, rg_transformer, True),
        ]
        for name, reference, ragged, run_nn, run_rg, uses_mem in pairs:
            reference, ragged = reference.to(DEVICE), ragged.to(DEVICE)
            load_from_nn(ragged, reference)
            check_parity(f"{name} ({tag})", reference, ragged, run_nn, run_rg, x, x_off,
                         mem if uses_mem else None, m_off if uses_mem else None)

# %%
# Dropout runs in training mode only
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With ``dropout=0.3``, the ragged transformer in eval mode must match the
# ``torch.nn`` one exactly (dropout off), and in training mode two calls must
# differ (dropout on).

reference = make_nn_transformer(E, NHEAD, 2, 2, dim_feedforward=FF, dropout=0.3).to(DEVICE).eval()
ragged = Transformer(E, NHEAD, 2, 2, dim_feedforward=FF, dropout=0.3).to(DEVICE)
load_from_nn(ragged, reference)
with torch.no_grad():
    x_pad, x_is_pad = to_padded(x, x_off)
    mem_pad, mem_is_pad = to_padded(mem, m_off)
    out_nn = from_padded(nn_transformer(reference, x_pad, x_is_pad, mem_pad, mem_is_pad), x_off)
    assert_close(ragged.eval()(mem, m_off, x, x_off), out_nn, atol=ATOL, rtol=RTOL)
    ragged.train()
    a, b = ragged(mem, m_off, x, x_off), ragged(mem, m_off, x, x_off)
    assert not torch.allclose(a, b), "dropout must be active in training mode"
print("eval mode: matches nn.Transformer; training mode: dropout active")

# %%
# The CUDA attention path, checked here too
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On CPU the NJT path of ``ragged_attention`` cannot run causal attention,
# but it can run the encoder, whose attention is not causal. Running the
# encoder parity check through it checks the packing, head split and
# offsets handling of the code that CUDA uses. (On CUDA it already ran above.)

if ATTENTION_PATH == "loop":
    ATTENTION_PATH = "nested"
    try:
        for norm_first in (False, True):
            kw = layer_kwargs(norm_first, "relu", True)
            reference = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(E, NHEAD, **kw, batch_first=True), 2,
                nn.LayerNorm(E), enable_nested_tensor=False).to(DEVICE)
            ragged = load_from_nn(TransformerEncoder(TransformerEncoderLayer(E, NHEAD, **kw), 2,
                                                     nn.LayerNorm(E)).to(DEVICE), reference)
            check_parity(f"Encoder via NJT SDPA (norm_first={norm_first})", reference, ragged,
                         nn_encoder, rg_encoder, x, x_off)
    finally:
        ATTENTION_PATH = "loop"

# %%
# Measured: ragged against padded
# -------------------------------
# Now the speed. We time the encoder stack and the full transformer,
# ``torch.nn`` on the padded batch with masks against the ragged layers on the
# packed batch, both compiled with ``torch.compile``. On the ragged side
# ``torch.compile`` compiles everything except the attention, which it calls
# eagerly on both paths (see above): the per-sequence loop on CPU, the NJT
# call on CUDA. So each layer is several graphs with the attention in
# between, on either device.
#
# Timings come from ``torch.utils.benchmark.Timer.blocked_autorange`` after a
# warm-up call, with as many threads as PyTorch uses; we print the median and
# the interquartile range (IQR). The peak memory is what one call allocates
# on top of what was already allocated: on CUDA from
# ``torch.cuda.max_memory_allocated``, on CPU from the allocation events of
# ``torch.profiler`` with ``profile_memory=True`` (CPU has no peak counter),
# summed in time order.

import itertools
import time

from torch.profiler import ProfilerActivity, profile
from torch.utils import benchmark


def time_ms(fn):
    """Median and IQR of ``fn()`` in milliseconds."""
    fn()  # warm-up
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn},
                            num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=MIN_RUN_TIME)
    if len(m.times) < 3:  # a slow call fills the time in one block: take 3 single runs
        m = benchmark.Measurement.merge([timer.timeit(1) for _ in range(3)])[0]
    return m.median * 1e3, m.iqr * 1e3


def peak_mib(fn):
    """Peak memory allocated by one call of ``fn``, above what was live before."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes())
                    for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return max(itertools.accumulate((b for _, b in events), initial=0)) / 2**20


MEMORY_COUNTER = ("torch.cuda.max_memory_allocated" if DEVICE == "cuda"
                  else "torch.profiler allocation events")

# %%
# The padding bound
# ~~~~~~~~~~~~~~~~~
# Skipping padding can at best save the work spent on it. We count the
# floating-point operations of both batches from the lengths alone: per
# token, ``8E^2 + 4E F`` for an encoder layer (QKV and output projections,
# feed-forward of width ``F``), ``12E^2 + 4E F`` for a decoder layer plus
# ``4E^2`` per memory token (cross-attention keys and values), and ``4E`` per
# pair of query and key in attention, counting the full score matrix on both
# sides (causal or not). The ratio of the padded count to the ragged one is
# the speedup that removing padding alone could give.


def encoder_flops(src_len, E, F, layers):
    return layers * sum((8 * E * E + 4 * E * F) * s + 4 * E * s * s for s in src_len)


def transformer_flops(src_len, tgt_len, E, F, layers):
    dec = layers * sum((12 * E * E + 4 * E * F) * t + 4 * E * E * s + 4 * E * (t * t + t * s)
                       for s, t in zip(src_len, tgt_len))
    return encoder_flops(src_len, E, F, layers) + dec


B, E, NHEAD, FF, LAYERS = (BENCH[k] for k in ("batch", "d_model", "nhead", "dim_ff", "layers"))
rng = np.random.default_rng(SEED)
src_len, tgt_len = sentence_lengths(rng, B), sentence_lengths(rng, B)
src_off, tgt_off = offsets_from_lengths(src_len), offsets_from_lengths(tgt_len)
src = torch.randn(sum(src_len), E, device=DEVICE)  # (T_src, E)
tgt = torch.randn(sum(tgt_len), E, device=DEVICE)  # (T_tgt, E)
src_pad, src_is_pad = to_padded(src, src_off)  # (B, S_src, E), (B, S_src)
tgt_pad, tgt_is_pad = to_padded(tgt, tgt_off)
tgt_causal = causal_mask(tgt_pad.shape[1])

pad_src, pad_tgt = [max(src_len)] * B, [max(tgt_len)] * B
BOUND = {
    "encoder": encoder_flops(pad_src, E, FF, LAYERS) / encoder_flops(src_len, E, FF, LAYERS),
    "transformer": transformer_flops(pad_src, pad_tgt, E, FF, LAYERS)
    / transformer_flops(src_len, tgt_len, E, FF, LAYERS),
}
print(f"source: {sum(src_len)} tokens, longest {max(src_len)}, padded {B * max(src_len)}")
print(f"target: {sum(tgt_len)} tokens, longest {max(tgt_len)}, padded {B * max(tgt_len)}")
print(f"padding bound (FLOP ratio padded / ragged): encoder {BOUND['encoder']:.2f}x, "
      f"transformer {BOUND['transformer']:.2f}x")

# %%
# Attention alone, on this device
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# First the choice of attention path, measured on the packed keys of the
# source batch (non-causal, forward and backward, eager): padded dense SDPA
# with a boolean padding mask, SDPA on NJT inputs, and the per-sequence loop.
# On CUDA the NJT path runs fused kernels; on CPU it runs the math path.

H, D = NHEAD, E // NHEAD
qkv = torch.randn(sum(src_len), 3, H, D, device=DEVICE, requires_grad=True)
qkv_pad, _ = to_padded(qkv.detach(), src_off)  # (B, S, 3, H, D)
qkv_pad.requires_grad_()
key_ok = ~src_is_pad[:, None, None, :]  # (B, 1, 1, S), True = attend


def attn_padded():
    q, k, v = qkv_pad.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, S, D)
    F.scaled_dot_product_attention(q, k, v, attn_mask=key_ok).sum().backward()


def attn_nested():
    q, k, v = qkv.unbind(1)
    _nested_attention(q, k, v, src_off, src_off, False, 0.0).sum().backward()


def attn_loop():
    q, k, v = qkv.unbind(1)
    _looped_attention(q, k, v, src_off, src_off, False, 0.0).sum().backward()


for name, fn in (("padded + mask", attn_padded), ("NJT SDPA", attn_nested),
                 ("per-sequence loop", attn_loop)):
    med, iqr = time_ms(fn)
    print(f"attention fwd+bwd, {name:<18} {med:7.2f} ms (IQR {iqr:.2f})")

# %%
# The encoder stack and the full transformer, compiled
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Both sides get the same weights and run in eval mode with dropout 0. We time
# the two halves of a training step: the forward pass with autograd recording
# (so it keeps what the backward pass needs, and its peak memory is the
# activation memory), and forward plus backward. Both halves use the one graph
# that ``torch.compile`` builds for the training step; forward-only inference
# under ``torch.no_grad`` would be a second graph per model, and on two CPU
# cores compiling costs more than everything else on this page, so we leave
# it out. The compile time is the first call's, printed apart from the
# timings.
#
# The backward pass starts from the same random output gradient on both
# sides (zero at the pad positions of ``torch.nn``), and each step first
# clears the parameter gradients, as a training step would.

torch.manual_seed(SEED)
bench_kw = dict(dim_feedforward=FF, dropout=0.0)
nn_encoder_stack = nn.TransformerEncoder(
    nn.TransformerEncoderLayer(E, NHEAD, batch_first=True, **bench_kw), LAYERS,
    nn.LayerNorm(E), enable_nested_tensor=False).to(DEVICE).eval()
rg_encoder_stack = load_from_nn(
    TransformerEncoder(TransformerEncoderLayer(E, NHEAD, **bench_kw), LAYERS, nn.LayerNorm(E)),
    nn_encoder_stack).to(DEVICE).eval()
nn_full = make_nn_transformer(E, NHEAD, LAYERS, LAYERS, **bench_kw).to(DEVICE).eval()
rg_full = load_from_nn(Transformer(E, NHEAD, LAYERS, LAYERS, **bench_kw), nn_full).to(DEVICE).eval()

cot_src, cot_tgt = torch.randn_like(src), torch.randn_like(tgt)
cases = {  # (model, side): (module, call, output gradient)
    ("encoder", "padded nn"): (
        nn_encoder_stack, lambda m: m(src_pad, src_key_padding_mask=src_is_pad),
        to_padded(cot_src, src_off)[0]),
    ("encoder", "ragged"): (rg_encoder_stack, lambda m: m(src, src_off), cot_src),
    ("transformer", "padded nn"): (
        nn_full, lambda m: m(src_pad, tgt_pad, tgt_mask=tgt_causal, tgt_is_causal=True,
                             src_key_padding_mask=src_is_pad, tgt_key_padding_mask=tgt_is_pad,
                             memory_key_padding_mask=src_is_pad),
        to_padded(cot_tgt, tgt_off)[0]),
    ("transformer", "ragged"): (rg_full, lambda m: m(src, src_off, tgt, tgt_off), cot_tgt),
}

results = {}
for (model, side), (module, call, cot) in cases.items():
    compiled = torch.compile(module)

    def forward():
        return call(compiled)

    def forward_backward():
        module.zero_grad(set_to_none=True)
        call(compiled).backward(cot)

    t0 = time.perf_counter()
    forward_backward()  # compiles forward and backward graphs
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    r = {"compile s": time.perf_counter() - t0}
    for mode, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
        r[mode + " ms"], r[mode + " iqr"] = time_ms(fn)
        r[mode + " MiB"] = peak_mib(fn)
    results[model, side] = r
    print(f"{model:<12} {side:<10} first call (compile) {r['compile s']:5.1f} s")

# %%
# The results, with the padding bound beside each speedup. Forward here
# means forward with autograd recording (see above).

print(f"{'':<24}{'forward ms (IQR)':>20}{'fwd+bwd ms (IQR)':>20}"
      f"{'fwd MiB':>10}{'fwd+bwd MiB':>13}")
for (model, side), r in results.items():
    print(f"{model + ', ' + side:<24}"
          f"{r['fwd ms']:>11.2f} ({r['fwd iqr']:5.2f})"
          f" {r['fwd+bwd ms']:>11.2f} ({r['fwd+bwd iqr']:5.2f})"
          f"{r['fwd MiB']:>10.1f}{r['fwd+bwd MiB']:>13.1f}")
print(f"peak memory: {MEMORY_COUNTER}, above what was allocated before the call")
for model in ("encoder", "transformer"):
    pad, rag = results[model, "padded nn"], results[model, "ragged"]
    print(f"{model:<12} speedup forward {pad['fwd ms'] / rag['fwd ms']:5.2f}x, "
          f"forward+backward {pad['fwd+bwd ms'] / rag['fwd+bwd ms']:5.2f}x, "
          f"peak memory {pad['fwd+bwd MiB'] / rag['fwd+bwd MiB']:5.2f}x lower; "
          f"padding bound {BOUND[model]:.2f}x")

# %%
# How to read these numbers. The padding bound is what removing the padding
# alone would give if both sides ran equally efficient kernels. A speedup
# below it is the cost of the ragged side's own overheads: the graph breaks
# around the eager attention on both devices, plus on CPU the Python loop over
# sequences and on CUDA the NJT bookkeeping. A speedup above it means the
# padded side loses more than its padding: on CUDA, given a padding mask,
# attention in ``torch.nn`` cannot use the flash kernel, which takes no mask;
# on either device the decoder adds the causal and padding masks into one
# ``(B * heads, S, S)`` tensor, while the ragged side calls a kernel that
# needs no mask at all. The
# memory ratio follows the number of tokens more closely, because
# activations are stored per token and, on the padded side, per pair of
# query and key.
#
# These timings come from the machine that built this page; on a shared
# machine the spread (IQR) shows how far to trust them. For the original
# building-blocks tutorial's multi-head attention layer on an A100 (batch 512,
# ``E = 512``; sample figures from that tutorial, not measured here), the
# nested version ran 5.65x faster forward; that tutorial did not seed its
# lengths, so the bound for its batch is unknown.

# %%
# Trained end to end
# ------------------
# Parity at initialization says nothing about whether training works, so we
# train both models on a toy sequence-to-sequence task that cannot be solved
# without attention: reverse a sequence of random symbols. The decoder must
# find, for output position ``t`` of a source of length ``L``, the source
# token at position ``L - 1 - t``, which takes cross-attention and knowledge
# of positions. The lengths follow the same Zipf sentence generator, capped
# at ``max_len``.
#
# Token ids: 0 is padding (used by the ``torch.nn`` side only), 1 starts the
# target, 2 ends it, and the symbols are ``3 .. VOCAB - 1``. The decoder input
# is ``[BOS] + reversed(source)``, its target ``reversed(source) + [EOS]``.

PAD, BOS, EOS, N_SYMBOLS = 0, 1, 2, 16
VOCAB = 3 + N_SYMBOLS


def reversal_batch(rng, batch, max_len):
    """Packed token ids and offsets of one batch of the reversal task."""
    lengths = sentence_lengths(rng, batch, max_len=max_len)
    src = [rng.integers(3, VOCAB, n) for n in lengths]
    tgt_in = [np.concatenate([[BOS], s[::-1]]) for s in src]
    tgt_out = [np.concatenate([s[::-1], [EOS]]) for s in src]
    as_ids = lambda seqs: torch.as_tensor(np.concatenate(seqs), device=DEVICE)
    src_off = offsets_from_lengths(lengths)
    tgt_off = offsets_from_lengths([n + 1 for n in lengths])
    return as_ids(src), src_off, as_ids(tgt_in), as_ids(tgt_out), tgt_off


# %%
# The two models share everything but the transformer in the middle: a token
# embedding, a learned position embedding (``nn.Transformer`` has none), and a
# linear head. The ``torch.nn`` one works on padded id tensors and builds the
# masks from them; the ragged one works on packed ids and offsets.


class PaddedSeq2Seq(nn.Module):
    def __init__(self, d_model, nhead, layers, dim_ff, dropout, max_len):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(max_len + 1, d_model)
        self.core = make_nn_transformer(d_model, nhead, layers, layers,
                                        dim_feedforward=dim_ff, dropout=dropout)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, src, tgt):  # (B, S_src), (B, S_tgt) ids -> (B, S_tgt, VOCAB)
        src_is_pad, tgt_is_pad = src == PAD, tgt == PAD
        pos_s = torch.arange(src.shape[1], device=src.device)
        pos_t = torch.arange(tgt.shape[1], device=tgt.device)
        h = self.core(self.embed(src) + self.pos(pos_s), self.embed(tgt) + self.pos(pos_t),
                      tgt_mask=causal_mask(tgt.shape[1], tgt.device), tgt_is_causal=True,
                      src_key_padding_mask=src_is_pad, tgt_key_padding_mask=tgt_is_pad,
                      memory_key_padding_mask=src_is_pad)
        return self.head(h)


class RaggedSeq2Seq(nn.Module):
    def __init__(self, d_model, nhead, layers, dim_ff, dropout, max_len):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(max_len + 1, d_model)
        self.core = Transformer(d_model, nhead, layers, layers,
                                dim_feedforward=dim_ff, dropout=dropout)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, src, src_off, tgt, tgt_off):  # (T_src,), (T_tgt,) ids -> (T_tgt, VOCAB)
        h = self.core(self.embed(src) + self.pos(token_index(src_off)[1]), src_off,
                      self.embed(tgt) + self.pos(token_index(tgt_off)[1]), tgt_off)
        return self.head(h)


# %%
# Both models start from the same weights and see the same batches in the
# same order, with the same seed for dropout. Both run eagerly: a new batch
# has new lengths, which would make a compiled model recompile for the first
# few batches, and the compile cost would swamp a run this short. Throughput
# counts real tokens (source plus target, no padding) per second of training.

DROPOUT = 0.1
cfg = dict(d_model=TRAIN["d_model"], nhead=TRAIN["nhead"], layers=TRAIN["layers"],
           dim_ff=TRAIN["dim_ff"], dropout=DROPOUT, max_len=TRAIN["max_len"])
torch.manual_seed(SEED)
padded_model = PaddedSeq2Seq(**cfg).to(DEVICE)
ragged_model = load_from_nn(RaggedSeq2Seq(**cfg), padded_model).to(DEVICE)

data_rng = np.random.default_rng(SEED + 1)
batches = [reversal_batch(data_rng, TRAIN["batch"], TRAIN["max_len"])
           for _ in range(TRAIN["steps"])]
held_out = reversal_batch(np.random.default_rng(SEED + 2), 256, TRAIN["max_len"])
n_tokens = sum(int(b[0].numel() + b[2].numel()) for b in batches)
n_padded = sum(int(b[1].diff().max() + b[4].diff().max()) * TRAIN["batch"] for b in batches)
print(f"{TRAIN['steps']} steps of {TRAIN['batch']} sequences, {n_tokens} real tokens in all; "
      f"padding makes them {n_padded / n_tokens:.2f}x as many")


def padded_step(model, batch):
    src, src_off, tgt_in, tgt_out, tgt_off = batch
    logits = model(to_padded(src, src_off, PAD)[0], to_padded(tgt_in, tgt_off, PAD)[0])
    target = to_padded(tgt_out, tgt_off, PAD)[0]  # (B, S_tgt)
    return logits, target


def ragged_step(model, batch):
    src, src_off, tgt_in, tgt_out, tgt_off = batch
    return model(src, src_off, tgt_in, tgt_off), tgt_out


def train(model, step):
    torch.manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, TRAIN["lr"], total_steps=TRAIN["steps"],
                                                pct_start=0.1)
    model.train()
    losses = []
    t0 = time.perf_counter()
    for batch in batches:
        logits, target = step(model, batch)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=PAD)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    return losses, n_tokens / seconds


@torch.no_grad()
def accuracy(model, step):
    """Teacher-forced accuracy on the held-out batch: per token and per sequence."""
    model.eval()
    logits, target = step(model, held_out)
    ok = logits.argmax(-1) == target
    if step is padded_step:  # (B, S): only real positions count
        real = target != PAD
        return ok[real].float().mean().item(), (ok | ~real).all(1).float().mean().item()
    tgt_off = held_out[4]
    seq, _ = token_index(tgt_off)  # sequence id of every target token
    per_seq = torch.zeros(len(tgt_off) - 1, device=DEVICE).index_add_(0, seq, (~ok).float())
    return ok.float().mean().item(), (per_seq == 0).float().mean().item()


curves, speed, acc = {}, {}, {}
for name, model, step in (("nn.Transformer, padded", padded_model, padded_step),
                          ("ragged Transformer", ragged_model, ragged_step)):
    curves[name], speed[name] = train(model, step)
    acc[name] = accuracy(model, step)
    first, last = np.mean(curves[name][:5]), np.mean(curves[name][-10:])
    print(f"{name:<24} loss {first:.3f} -> {last:.3f}, {speed[name]:,.0f} tokens/s, "
          f"held-out accuracy {acc[name][0]:.1%} per token, {acc[name][1]:.1%} per sequence")

# %%
# Both must learn: the page stops unless the mean loss over the last ten
# steps is below half of the mean over the first five. (Both start near
# ``ln(VOCAB)``, about 2.9.) In quick mode, with fewer steps, the threshold is
# 75% of the start instead, which a model that does not learn still fails.
# The two curves are not identical, because dropout draws different random
# masks for padded and packed tensors, but they should lie close together.

threshold = 0.75 if QUICK else 0.5
for name, losses in curves.items():
    first, last = np.mean(losses[:5]), np.mean(losses[-10:])
    assert last < threshold * first, f"{name} did not learn: loss {first:.3f} -> {last:.3f}"
print(f"both losses fell below {threshold:.0%} of their start")

import matplotlib.pyplot as plt

# sphinx_gallery_thumbnail_number = 1

fig, ax = plt.subplots(figsize=(7, 4))
for name, losses in curves.items():
    ax.plot(losses, label=f"{name} ({speed[name]:,.0f} tokens/s)", alpha=0.8)
ax.set_xlabel("training step")
ax.set_ylabel("cross-entropy loss")
ax.set_yscale("log")
ax.set_title("Reversing ragged sequences: nn.Transformer (padded) vs ragged")
ax.legend()
fig.tight_layout()
plt.show()

# %%
# On two CPU cores at this tiny size, the ragged model may well train more
# slowly than the padded one: the training lengths are capped, so padding
# adds little work, while the eager per-sequence attention loop costs a few
# hundred small kernel calls per step. With uncapped lengths, as in the
# benchmark above, the padding dominates instead; on CUDA the fused NJT
# kernels replace the loop altogether.
#
# Conclusion
# ----------
# Every layer of the ``nn.Transformer`` family fits in a few dozen lines
# once the batch is packed values plus offsets: per-token layers run on the
# packed values unchanged, and only attention needs the offsets. No
# ``*_padding_mask`` is left, and the causal mask of the decoder becomes a
# flag. The layers match ``torch.nn`` output for output and gradient for
# gradient, in both ``norm_first`` settings, and the ragged transformer
# learns the same task from the same start.
#
# What runs where, in PyTorch 2.13: on CUDA, SDPA on nested tensors with
# fused kernels; on CPU, a loop of dense SDPA calls over the sequences,
# because the nested-tensor SDPA path on CPU has no causal support and is
# slow, and FlexAttention has no backward on CPU. Since nested tensors are no
# longer developed actively, the CUDA path is the part most likely to change:
# ``torch.nn.attention.varlen.varlen_attn`` takes the same packed values and
# offsets (causal is ``window_size=(-1, 0)``), so switching is a change to
# ``ragged_attention`` only.
#
# References
# ----------
# * The original tutorial, `Accelerating PyTorch Transformers by replacing
#   nn.Transformer with Nested Tensors and torch.compile()
#   <https://pytorch.org/tutorials/intermediate/transformer_building_blocks.html>`_
# * `torch.nested documentation <https://pytorch.org/docs/stable/nested.html>`_
# * `scaled_dot_product_attention
#   <https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html>`_
# * `nn.Transformer <https://pytorch.org/docs/stable/generated/torch.nn.Transformer.html>`_
# * Vaswani et al., `Attention Is All You Need <https://arxiv.org/abs/1706.03762>`_
# * Xiong et al., `On Layer Normalization in the Transformer Architecture
#   <https://arxiv.org/abs/2002.04745>`_ (``norm_first``)
# * `attention-gym <https://github.com/pytorch-labs/attention-gym>`_ (document
#   masks over packed sequences)
