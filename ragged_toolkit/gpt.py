"""A small GPT (RMSNorm, rotary positions, SwiGLU, grouped-query attention) in
the style of gpt-fast, whose attention is told the batch's *layout*
(:mod:`ragged_toolkit.layouts`): packed, padded, packed rows, a KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


__all__ = ["GPTConfig", "Attention", "Block", "GPT"]


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a :class:`GPT`: vocabulary, width ``dim``, layers, query
    and key/value heads (grouped-query attention when ``n_kv_heads < n_heads``),
    the SwiGLU hidden width and the longest position."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    max_seq_len: int
    rope_base: float = 10000.0

    @property
    def head_dim(self):
        return self.dim // self.n_heads


def _apply_rope(x, cos, sin):
    """Rotary position embedding: x (..., H, D) rotated by the angles whose
    cosines and sines are (..., 1, D / 2), one row per token's position."""
    # Rotated in the precision of cos and sin (float32), returned in the dtype
    # of x: under autocast, q and k stay in the dtype of v.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions: q, k and v from one
    matmul, attention by the batch's layout (a
    :class:`~ragged_toolkit.layouts.Layout`). ``forward(x, cos, sin, layout)``: x (T, dim) or
    (B, S, dim), returns the same shape."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = layer, cfg.n_heads, cfg.n_kv_heads
        kv = cfg.n_kv_heads * cfg.head_dim
        self.sizes = [cfg.n_heads * cfg.head_dim, kv, kv]
        self.wqkv = nn.Linear(cfg.dim, sum(self.sizes), bias=False)  # one matmul for q, k, v
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, layout):
        q, k, v = self.wqkv(x).split(self.sizes, dim=-1)
        q = _apply_rope(q.unflatten(-1, (self.n_heads, -1)), cos, sin)
        k = _apply_rope(k.unflatten(-1, (self.n_kv_heads, -1)), cos, sin)
        v = v.unflatten(-1, (self.n_kv_heads, -1))
        return self.wo(layout.attend(q, k, v, self.layer).flatten(-2))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(gate) * up)``, gate and up from one matmul. Works on
    the last dimension: (..., dim) -> (..., dim)."""

    def __init__(self, cfg):
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_hidden, bias=False)  # gate and up, one matmul
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    """A pre-norm decoder block: RMSNorm, :class:`Attention`, residual;
    RMSNorm, ``FeedForward``, residual."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attn, self.ffn = Attention(cfg, layer), FeedForward(cfg)

    def forward(self, x, cos, sin, layout):
        x = x + self.attn(self.attn_norm(x), cos, sin, layout)
        return x + self.ffn(self.ffn_norm(x))


class GPT(nn.Module):
    """A decoder-only transformer (RMSNorm, rotary positions, SwiGLU, GQA) in
    the style of gpt-fast. ``forward(tokens, positions, layout)``: tokens and
    positions (T,) packed with a ``PackedLayout``, or (B, S) padded with a
    ``PaddedLayout`` (:mod:`ragged_toolkit.layouts`); returns logits (T,
    vocab) or (B, S, vocab).
    Positions restart at every sequence: ``token_index`` gives them."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        half = cfg.head_dim // 2
        freqs = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), freqs)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, tokens, positions, layout):
        # tokens, positions: (T,) packed or (B, S) padded -> logits (..., vocab)
        x = self.tok_embeddings(tokens)
        cos = self.cos[positions].unsqueeze(-2).to(x.dtype)  # (..., 1, D / 2)
        sin = self.sin[positions].unsqueeze(-2).to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, layout)
        return self.output(self.norm(x))
