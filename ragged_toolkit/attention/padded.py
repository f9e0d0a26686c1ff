"""The ``padded`` and ``bucketed`` backends: sequences padded into
rectangles, every sequence to the longest (one call) or in groups of similar
length (a few calls, a little padding)."""

import numpy as np
import torch
import torch.nn.functional as F

from .dense import dense_attention


def bucket_plan(plan, device, buckets, is_causal):
    """Sequences sorted by length and cut into ``buckets`` groups; for each, the
    indices that gather its rows into a padded block (padding slots read row 0
    and are masked or dropped), its mask, and which slots are real queries;
    then where each packed query row lands among the groups' outputs."""
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
        q_idx = torch.where(q_real, torch.as_tensor(q_start[group])[:, None] + torch.arange(q_real.shape[1]), 0)
        kv_idx = torch.where(kv_real, torch.as_tensor(kv_start[group])[:, None]
                             + torch.arange(kv_real.shape[1]), 0)
        mask = kv_real[:, None, :]  # (n, 1, Skv): real keys only
        if is_causal:  # query i sees keys up to i + Lkv - Lq
            key, query = torch.arange(kv_real.shape[1]), torch.arange(q_real.shape[1])[:, None]
            mask = mask & (key <= query + (lkv - lq)[:, None, None])
        # right padding, equal lengths: a causal query never reaches a padding
        # key, and the kernel's own causal mask is enough
        mask = None if is_causal and bool((lq == lkv).all()) else mask[:, None].to(device)
        groups.append((q_idx.to(device), kv_idx.to(device), mask, q_real.to(device)))
        rows.append(q_idx[q_real])
    return groups, torch.argsort(torch.cat(rows)).to(device)


def bucketed_backend(q, k, v, plan, is_causal, scale, kv_used=None, buckets=4):
    """Sequences padded in groups of similar length; one dense SDPA call per group."""
    key = ("bucketed", buckets, is_causal)
    if key not in plan.prepared:
        plan.prepared[key] = bucket_plan(plan, q.device, buckets, is_causal)
    groups, inverse = plan.prepared[key]
    out = []
    for q_idx, kv_idx, mask, q_real in groups:
        qb, kb, vb = (t[i].transpose(1, 2) for t, i in ((q, q_idx), (k, kv_idx), (v, kv_idx)))
        ob = dense_attention(qb, kb, vb, is_causal and mask is None, scale, mask)  # (n, H, Sq, D)
        out.append(ob.transpose(1, 2)[q_real])  # the real rows, (sum Lq, H, D)
    return torch.cat(out)[inverse]


def padded_backend(q, k, v, plan, is_causal, scale, kv_used=None):
    """Every sequence padded to the longest one, one SDPA call: the baseline.
    A batch that already is a rectangle (as many queries and key rows in every
    sequence, as a KV cache with the same room for each) is viewed as one,
    with no copy, and the keys not in use are masked."""
    B, lq, rows = len(plan.q_lengths), plan.q_lengths[0], plan.kv_rows[0]
    if set(plan.q_lengths) != {lq} or set(plan.kv_rows) != {rows}:
        return bucketed_backend(q, k, v, plan, is_causal, scale, buckets=1)
    n = max(plan.kv_lengths)
    if ("rectangle", is_causal) not in plan.prepared:  # one mask per batch, for every layer
        # the counts as given (no copy from the host where there is one)
        used = torch.tensor(plan.kv_lengths) if kv_used is None else kv_used
        used = used.to(q.device)[:, None, None, None]
        key, query = torch.arange(n, device=q.device), torch.arange(lq, device=q.device)[:, None]
        mask = key < used  # (B, 1, 1, n), or with the causal rule (B, 1, Lq, n)
        plan.prepared["rectangle", is_causal] = mask & (key <= query + used - lq) if is_causal else mask
    qb = q.view(B, lq, *q.shape[1:]).transpose(1, 2)  # (B, H, Lq, D)
    kb, vb = (t.view(B, rows, *t.shape[1:])[:, :n].transpose(1, 2) for t in (k, v))  # (B, H_kv, n, D)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=plan.prepared["rectangle", is_causal],
                                         scale=scale, enable_gqa=qb.shape[1] != kb.shape[1])
    return out.transpose(1, 2).reshape(q.shape)
