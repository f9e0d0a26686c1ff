"""Attention through a paged KV cache's block tables: the layout of a
serving step (:class:`PagedLayout`) and three ways to read the cache
(:data:`PAGED_PATHS`): gathered into a packed batch for
``ragged_attention``, in place with FlexAttention's paged mask, in place
with ``varlen_attn``'s ``block_table``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import backend_support, plan_batch, ragged_attention
from ..attention.dense import shares_heads
from ..attention.flex import FLEX_BLOCK, flex_rows, flex_runner
from ..attention.varlen import varlen_attn, varlen_kwargs, varlen_missing
from ..batches import offsets_from_lengths, token_index
from ..kv_cache import PagedKVCache, paged_rows

__all__ = ["PagedLayout", "PAGED_PATHS", "paged_varlen_support"]


@dataclass(frozen=True)
class PagedLayout:
    """A step of a :class:`~ragged_toolkit.gpt.GPT` over a
    :class:`~ragged_toolkit.kv_cache.PagedKVCache`: the new tokens packed
    with ``q_offsets`` (B + 1,), their rows ``slots`` (T,) and ``positions``
    (T,); each sequence's keys in use ``kv_lengths`` (B,) and
    ``block_table`` (B, max_blocks), and the longest of each. ``path`` says
    how attention reads the keys (:data:`PAGED_PATHS`); ``flex`` is the
    :class:`~ragged_toolkit.attention.flex.FlexKernel` of the ``flex``
    path (and of a gathered step's plan on the flex backend); ``prepared`` is what
    that path builds once per step, for every layer (``prepare_paged``).
    Frozen: built once per step, by
    ``build_step``, and only read after."""

    cache: PagedKVCache
    q_offsets: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    kv_lengths: torch.Tensor
    block_table: torch.Tensor
    max_q: int
    max_kv: int
    path: str = "gathered"
    flex: object = None  # the caller's FlexKernel, for the flex path outside torch.compile
    prepared: object = None

    def attend(self, q, k, v, layer):  # (T, H, D), (T, H_kv, D) -> (T, H, D)
        self.cache.write(layer, k, v, self.slots)
        return PAGED_PATHS[self.path](q, self, layer)


def gathered_attention(q, step, layer):
    """The keys in use, gathered through the block table into a packed
    batch, then ``ragged_attention`` with the step's plan, causal (aligned
    bottom-right: the new queries are each sequence's last): q (T, H, D)
    -> (T, H, D)."""
    rows, plan = step.prepared  # the cache rows of every key in use, and the batch's plan
    k, v = step.cache.k[layer].index_select(0, rows), step.cache.v[layer].index_select(0, rows)
    return ragged_attention(q, k, v, plan)


def _paged_block_mask(step):
    """A FlexAttention ``BlockMask`` of the new queries (padded to
    ``flex_rows``) against every row of
    the cache: a query sees a row that its sequence's block table names, at
    a position up to its own."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = step.q_offsets.device
    n_rows, t_q = step.cache.k.shape[1], len(step.positions)
    n_q = flex_rows(t_q)
    rows = paged_rows(step.block_table, step.kv_lengths, step.cache.block_size)
    seq, pos = token_index(offsets_from_lengths(step.kv_lengths, device))
    owner = torch.full((n_rows,), -1, device=device).index_put_((rows,), seq)
    row_pos = torch.zeros(n_rows, dtype=torch.long, device=device).index_put_((rows,), pos)
    q_seq = F.pad(token_index(step.q_offsets)[0], (0, n_q - t_q), value=-2)  # padding sees nothing
    q_pos = F.pad(step.positions, (0, n_q - t_q))

    def paged_causal(b, h, q_idx, kv_idx):
        return (owner[kv_idx] == q_seq[q_idx]) & (row_pos[kv_idx] <= q_pos[q_idx])

    return create_block_mask(
        paged_causal, None, None, n_q, n_rows, device=device, BLOCK_SIZE=FLEX_BLOCK
    )


def _flex_paged_attention(q, step, layer):
    """FlexAttention reading the cache in place with ``_paged_block_mask``,
    the new queries as one padded sequence: q (T, H, D) -> (T, H, D)."""
    mask = step.prepared
    attend = flex_runner(
        step.flex, "build_step(..., path='flex', flex=flex), serve(..., flex=flex)"
    )
    qf = F.pad(q, (0, 0, 0, 0, 0, mask.seq_lengths[0] - len(q))).transpose(0, 1)[None]
    kf, vf = (t[layer].transpose(0, 1)[None] for t in (step.cache.k, step.cache.v))
    out = attend(
        qf,
        kf,
        vf,
        block_mask=mask,  # (1, H, n_q, D), (1, H_kv, rows, D)
        enable_gqa=shares_heads(qf, kf),
    )
    return out[0, :, : len(q)].transpose(0, 1)


def _varlen_paged_attention(q, step, layer):
    """``varlen_attn`` reading the cache in place through ``block_table``
    and ``seqused_k`` (FlashAttention's paged kernel), one split of the keys
    (``num_splits=1``: split-KV on the paged path has left rows unwritten,
    pytorch/pytorch#194167): q (T, H, D) -> (T, H, D)."""
    c, lengths = step.cache, step.kv_lengths.to(torch.int32)
    k, v = (t[layer].view(c.n_blocks, c.block_size, *t.shape[2:]) for t in (c.k, c.v))  # pages
    kw = varlen_kwargs(
        is_causal=True,
        enable_gqa=q.shape[1] != k.shape[2],
        seqused_k=lengths,
        block_table=step.block_table,
        num_splits=1,
    )
    return varlen_attn(
        q,
        k,
        v,
        step.q_offsets.to(torch.int32),
        offsets_from_lengths(lengths).int(),
        step.max_q,
        step.max_kv,
        **kw,
    )


#: How a :class:`PagedLayout` reads the cache: name -> ``fn(q, step, layer)``.
PAGED_PATHS = {
    "gathered": gathered_attention,
    "flex": _flex_paged_attention,
    "varlen": _varlen_paged_attention,
}


def prepare_paged(step, backend=None):
    """What ``step.path`` builds once per step, for every layer: for
    ``gathered``, the cache rows of every key in use and the batch's plan on
    ``backend`` (``plan_batch``); for ``flex``, ``_paged_block_mask``;
    for ``varlen``, nothing."""
    if step.path == "gathered":
        rows = paged_rows(step.block_table, step.kv_lengths, step.cache.block_size)
        kv_offsets = offsets_from_lengths(step.kv_lengths, rows.device)
        plan = plan_batch(
            step.q_offsets, kv_offsets, backend=backend, is_causal=True, flex=step.flex
        )
        return rows, plan
    if step.path == "flex":
        return _paged_block_mask(step)
    if step.path == "varlen":
        return None
    raise ValueError(f"unknown path {step.path!r}; choose one of {sorted(PAGED_PATHS)}")


def paged_varlen_support(device, dtype, block_size):
    """None if ``varlen_attn`` can read a paged cache here, else why not."""
    why = backend_support("varlen", device, dtype, is_causal=True, gqa=True)
    if why:
        return why
    missing = varlen_missing(["causal", "enable_gqa", "seqused_k", "block_table", "num_splits"])
    if missing:
        return f"this release's varlen_attn has no {', '.join(missing)}"
    if block_size % 256:
        return f"blocks of {block_size} rows: FlashAttention's paged kernel needs a multiple of 256"
    return None
