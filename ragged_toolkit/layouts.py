"""How a model's attention reads a batch: its *layout*. A model computes its
queries, keys and values the same way for every batch and hands them to
``layout.attend(q, k, v, layer)``; the layout knows whether the tokens are
packed (:class:`PackedLayout`, through ``ragged_attention`` and the batch's
plan), padded (:class:`PaddedLayout`), packed into fixed-length rows
(:class:`PackedRows`), or read through a KV cache
(``CachedStep`` in :mod:`ragged_toolkit.kv_cache`, ``PagedLayout`` in
:mod:`ragged_toolkit.serving.paged_attention`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .attention import BatchPlan, default_backend, plan_batch, ragged_attention
from .attention.dense import shares_heads
from .batches import token_index

__all__ = ["Layout", "PackedLayout", "PaddedLayout", "PackedRows"]


class Layout(Protocol):
    """What every layout does: attention of layer ``layer``'s queries q over
    its keys k and values v, as the batch lays them out (packed (T, H, D),
    padded (B, S, H, D), ...); returns the queries' shape."""

    def attend(self, q, k, v, layer): ...


@dataclass
class PackedLayout:
    """A packed batch: the batch's plan (``plan_batch``, causal, built once
    for every layer); for a KV cache, the cache (its rows are the plan's
    keys) and each new token's row in it."""

    plan: BatchPlan
    cache: object = None  # a kv_cache.KVCache
    rows: torch.Tensor | None = None  # (T,)

    @classmethod
    def of(cls, offsets, backend=None, dtype=torch.float32, *, flex=None):
        """The layout of a packed batch with ``offsets`` (B + 1,), causal, on
        ``backend`` (default: ``default_backend`` for ``dtype`` on the
        offsets' device; ``flex``: the caller's ``FlexKernel``, for
        ``flex``): its plan built here, once."""
        backend = default_backend(offsets.device, dtype) if backend is None else backend
        return cls(plan_batch(offsets, backend=backend, is_causal=True, flex=flex))

    def attend(self, q, k, v, layer):  # (T, H, D), (T, H_kv, D)
        if self.cache is not None:
            k, v = self.cache.write_rows(layer, k, v, self.rows)
        return ragged_attention(q, k, v, self.plan)


@dataclass
class PaddedLayout:
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
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, is_causal=self.mask is None, enable_gqa=shares_heads(q, k)
        )
        return out.transpose(1, 2)


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
        q, k, v = (
            t.view(rows, row_len, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)
        )  # (N, H, L, D)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, enable_gqa=shares_heads(q, k)
        )
        return out.transpose(1, 2).flatten(0, 1)  # (N * L, H, D)
