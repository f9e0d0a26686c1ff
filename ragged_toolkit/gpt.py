"""A small GPT (RMSNorm, rotary positions, SwiGLU, grouped-query attention) in
the style of gpt-fast, whose attention is told the batch's *layout*: packed
(:class:`Packed`) or padded (:class:`Padded`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import ragged_attention
from .batches import token_index


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


@dataclass
class Packed:
    """A packed batch: offsets of the new tokens, the attention backend, and
    for a KV cache each new token's row and each sequence's keys in use."""

    offsets: torch.Tensor  # (B + 1,)
    backend: str | None = None
    cache: object = None  # a kv_cache.KVCache
    rows: torch.Tensor | None = None  # (T,)
    kv_used: torch.Tensor | None = None  # (B,)

    def attend(self, q, k, v, layer):  # (T, H, D), (T, H_kv, D)
        kv_offsets = None
        if self.cache is not None:
            k, v = self.cache.write_rows(layer, k, v, self.rows)
            kv_offsets = self.cache.row_offsets
        return ragged_attention(q, k, v, self.offsets, kv_offsets, is_causal=True, kv_used=self.kv_used,
                                backend=self.backend)


@dataclass
class Padded:
    """A padded batch (B, S): no mask (right padding, a causal kernel) or a
    (B, 1, S, S_kv) mask, True where a query may see a key; for a KV cache,
    the column the new tokens start at."""

    mask: torch.Tensor | None = None
    cache: object = None  # a kv_cache.KVCache
    start: int = 0

    def attend(self, q, k, v, layer):  # (B, S, H, D), (B, S, H_kv, D)
        if self.cache is not None:
            k, v = self.cache.write_columns(layer, k, v, self.start)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.mask is None,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)


def apply_rope(x, cos, sin):
    """Rotary position embedding: x (..., H, D) rotated by the angles whose
    cosines and sines are (..., 1, D / 2), one row per token's position."""
    # Rotated in the precision of cos and sin (float32), returned in the dtype
    # of x: under autocast, q and k stay in the dtype of v.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions: q, k and v from one
    matmul, attention by the batch's layout (:class:`Packed` or
    :class:`Padded`). ``forward(x, cos, sin, layout)``: x (T, dim) or
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
        q = apply_rope(q.unflatten(-1, (self.n_heads, -1)), cos, sin)
        k = apply_rope(k.unflatten(-1, (self.n_kv_heads, -1)), cos, sin)
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
    RMSNorm, :class:`FeedForward`, residual."""

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
    positions (T,) packed with a :class:`Packed` layout, or (B, S) padded with
    a :class:`Padded` one; returns logits (T, vocab) or (B, S, vocab).
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


@dataclass
class PackedRows:
    """``N`` packed rows of ``L`` tokens, seen as ``(N * L,)`` tokens: every
    row holds whole documents or pieces of them, and attention is one SDPA
    call over the rows with a block-diagonal causal mask, ``(N, 1, L, L)``,
    True where a query may see a key. The mask is built once per batch,
    outside a compiled model (:meth:`from_offsets`); every shape is fixed, so
    a compiled model compiles once, with no graph break. It scores every
    pair of a row and masks those across documents."""

    mask: torch.Tensor  # (N, 1, L, L)

    @classmethod
    def from_offsets(cls, offsets, row_len):
        """The layout of a batch of ``N * row_len`` tokens whose offsets mark
        every document, and every row start."""
        document = token_index(offsets)[0].view(-1, row_len)  # (N, L): each token's sequence
        causal = torch.ones(row_len, row_len, dtype=torch.bool, device=offsets.device).tril()
        return cls(((document[:, :, None] == document[:, None, :]) & causal)[:, None])

    def attend(self, q, k, v, layer):  # (N * L, H, D), (N * L, H_kv, D)
        rows, row_len = self.mask.shape[0], self.mask.shape[-1]
        q, k, v = (t.view(rows, row_len, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))  # (N, H, L, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).flatten(0, 1)  # (N * L, H, D)


@dataclass
class FlexRows:
    """The same packed rows as :class:`PackedRows`, attended by FlexAttention
    with a document-causal ``BlockMask`` over the whole batch (built once per
    batch, outside a compiled model: :meth:`from_offsets`), which skips the
    blocks across documents. Inside a compiled model ``flex_attention`` is
    compiled with it, into one graph."""

    block_mask: object  # torch.nn.attention.flex_attention.BlockMask

    @classmethod
    def from_offsets(cls, offsets, row_len):
        """The layout of a batch of ``N * row_len`` tokens whose offsets mark
        every document, and every row start."""
        from torch.nn.attention.flex_attention import create_block_mask

        document = token_index(offsets)[0]  # (N * L,): each token's sequence

        def document_causal(b, h, q_idx, kv_idx):
            return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

        n = len(document)
        return cls(create_block_mask(document_causal, None, None, n, n, device=offsets.device))

    def attend(self, q, k, v, layer):  # (T, H, D), (T, H_kv, D)
        from torch.nn.attention.flex_attention import flex_attention

        out = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                             block_mask=self.block_mask, enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)  # (T, H, D)
