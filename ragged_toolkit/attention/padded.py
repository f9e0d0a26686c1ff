"""The ``padded`` and ``bucketed`` backends: sequences padded into
rectangles, every sequence to the longest (one call) or in groups of similar
length (a few calls, a little padding)."""

import numpy as np
import torch
import torch.nn.functional as F

from .dense import dense_attention, many_shapes_kernels, shares_heads

__all__ = []

#: How many groups of similar length ``bucketed`` pads the sequences in.
BUCKETS = 4


def _bucket_plan(plan, buckets):
    """Sequences sorted by length and cut into ``buckets`` groups; for each,
    the indices that gather its rows into a padded block (padding slots read
    row 0 and are masked or dropped), its mask, and the slots that hold real
    queries; then where each packed query row lands among the groups' outputs."""
    device = plan.q_offsets.device
    order = sorted(range(len(plan.q_lengths)), key=lambda i: -plan.kv_lengths[i])
    q_start = np.concatenate([[0], np.cumsum(plan.q_lengths)])
    kv_start = np.concatenate([[0], np.cumsum(plan.kv_rows)])
    groups, rows = [], []
    for group in np.array_split(np.array(order), min(buckets, len(order))):
        lq = torch.tensor([plan.q_lengths[i] for i in group])
        lkv = torch.tensor([plan.kv_lengths[i] for i in group])
        q_real = torch.arange(int(lq.max())) < lq[:, None]  # (n, Sq)
        kv_real = torch.arange(int(lkv.max())) < lkv[:, None]  # (n, Skv)
        # the packed row of each slot: the sequence's first row plus the slot
        q_idx = torch.where(
            q_real, torch.as_tensor(q_start[group])[:, None] + torch.arange(q_real.shape[1]), 0
        )
        kv_idx = torch.where(
            kv_real, torch.as_tensor(kv_start[group])[:, None] + torch.arange(kv_real.shape[1]), 0
        )
        mask = kv_real[:, None, :]  # (n, 1, Skv): real keys only
        if plan.is_causal:  # query i sees keys up to i + Lkv - Lq
            key, query = torch.arange(kv_real.shape[1]), torch.arange(q_real.shape[1])[:, None]
            mask = mask & (key <= query + (lkv - lq)[:, None, None])
        # right padding, equal lengths: a causal query never reaches a padding
        # key, and the kernel's own causal mask is enough
        mask = None if plan.is_causal and bool((lq == lkv).all()) else mask[:, None].to(device)
        real_slots = q_real.flatten().nonzero().flatten()  # the real queries among the n * Sq slots
        groups.append((q_idx.to(device), kv_idx.to(device), mask, real_slots.to(device)))
        rows.append(q_idx[q_real])
    return groups, torch.argsort(torch.cat(rows)).to(device)


def prepare_bucketed(plan):
    """What ``bucketed`` builds once per batch: ``_bucket_plan`` in
    ``BUCKETS`` groups."""
    return _bucket_plan(plan, BUCKETS)


def _attend_in_groups(q, k, v, groups, inverse, is_causal, scale=None):
    """One dense SDPA call per padded group of ``_bucket_plan``: q (T_q, H,
    D), k and v (T_kv, H_kv, D) -> (T_q, H, D)."""
    out = []
    for q_idx, kv_idx, mask, real_slots in groups:
        qb, kb, vb = (
            t[i].transpose(1, 2) for t, i in ((q, q_idx), (k, kv_idx), (v, kv_idx))
        )  # (n, H, S, D)
        ob = dense_attention(qb, kb, vb, is_causal and mask is None, scale, mask)  # (n, H, Sq, D)
        out.append(ob.transpose(1, 2).flatten(0, 1)[real_slots])  # the real rows, (sum Lq, H, D)
    return torch.cat(out)[inverse]


def bucketed_backend(q, k, v, plan, scale=None):
    """Sequences padded in groups of similar length; one dense SDPA call per
    group. The groups' shapes change from batch to batch, so on CUDA
    cuDNN attention comes after flash and memory-efficient attention here
    (``many_shapes_kernels``); the ``padded`` baseline keeps SDPA's own
    order, the kernel a practitioner gets."""
    with many_shapes_kernels(q.device):
        return _attend_in_groups(q, k, v, *plan.prepared, plan.is_causal, scale)


def prepare_padded(plan):
    """What ``padded`` builds once per batch: a batch that already is a
    rectangle (as many queries and key rows in every sequence, as a KV cache
    with the same room for each) keeps its shape and gets the mask of its
    keys in use, (B, 1, Lq or 1, n); any other batch one padded group."""
    lq, rows = plan.q_lengths[0], plan.kv_rows[0]
    if set(plan.q_lengths) != {lq} or set(plan.kv_rows) != {rows}:
        return "padded", _bucket_plan(plan, 1)
    device, n = plan.q_offsets.device, max(plan.kv_lengths)
    used = torch.tensor(plan.kv_lengths) if plan.kv_used is None else plan.kv_used
    used = used.to(device)[:, None, None, None]
    key, query = torch.arange(n, device=device), torch.arange(lq, device=device)[:, None]
    mask = key < used  # (B, 1, 1, n), or with the causal rule (B, 1, Lq, n)
    return "rectangle", (mask & (key <= query + used - lq) if plan.is_causal else mask, n)


def padded_backend(q, k, v, plan, scale=None):
    """Every sequence padded to the longest one, one SDPA call: the baseline.
    A rectangle (``prepare_padded``) is viewed as one, with no copy, and
    the keys not in use are masked."""
    kind, prepared = plan.prepared
    if kind == "padded":  # one group, every sequence as long as the longest
        return _attend_in_groups(q, k, v, *prepared, plan.is_causal, scale)
    mask, n = prepared
    B, lq, rows = len(plan.q_lengths), plan.q_lengths[0], plan.kv_rows[0]
    qb = q.view(B, lq, *q.shape[1:]).transpose(1, 2)  # (B, H, Lq, D)
    kb, vb = (
        t.view(B, rows, *t.shape[1:])[:, :n].transpose(1, 2) for t in (k, v)
    )  # (B, H_kv, n, D)
    out = F.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=shares_heads(qb, kb)
    )
    return out.transpose(1, 2).reshape(q.shape)
