"""Shared-prefix (cascade) attention in a decoding step: the requests of a
step whose block tables begin with the same cached blocks have their
queries scored against that prefix's keys in one call, read once, and each
request against its own suffix; the two parts are merged by log-sum-exp,
exactly (FlashInfer's cascade attention; attention-gym's
``shared_prefix_split_attention``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SharedPrefixPlan", "plan_shared_prefix", "shared_prefix_attention"]


def _attention_lse(q, k, v, mask=None, scale=None):
    """Attention with its log-sum-exp: q (..., Lq, D), k and v (..., Lk, D),
    ``mask`` (broadcast to (..., Lq, Lk)) True where a query sees a key;
    every query sees at least one. Returns the output (..., Lq, D) and the
    log-sum-exp of the scaled scores (..., Lq), in float32 at least."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2)  # (..., Lq, Lk), in float32 at least
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = scores.softmax(-1)  # (..., Lq, Lk)
    # the top score's probability is exp(top - lse): the log-sum-exp, without a second exp pass
    lse = scores.amax(-1) - p.amax(-1).log()  # (..., Lq)
    return p.to(v.dtype) @ v, lse


def _merge_by_lse(out_a, lse_a, out_b, lse_b):
    """Attention over the keys of two parts, from each part's output (..., D)
    and log-sum-exp (...): each part weighs by its share of the whole
    softmax denominator, ``exp(lse_a) / (exp(lse_a) + exp(lse_b))`` for the
    first, ``sigmoid(lse_a - lse_b)``."""
    share_a = torch.sigmoid(lse_a - lse_b)[..., None].to(out_a.dtype)  # (..., 1)
    return out_b + (out_a - out_b) * share_a


@dataclass
class SharedPrefixPlan:
    """A decoding step's requests (one query each) whose tables begin with
    the same blocks: the cache rows of that prefix (L,), and of each
    request's own keys after it, padded ((Q, S_max), ``suffix_used`` True
    where a row is in use). Built once per step, read by every layer."""

    prefix_rows: torch.Tensor  # (L,)
    suffix_rows: torch.Tensor  # (Q, S_max)
    suffix_used: torch.Tensor  # (Q, S_max) bool


def plan_shared_prefix(cache, rids, kv_lengths, device):
    """The :class:`SharedPrefixPlan` of requests ``rids`` of a paged
    ``cache``, each using its first ``kv_lengths[i]`` keys: the prefix is
    the blocks their tables all begin with (whole blocks, at most each
    request's keys but its last: a suffix is never empty). Raises
    ``ValueError`` if they share no block."""
    tables, size = [cache.tables[r] for r in rids], cache.block_size
    common = 0
    while all(len(t) > common and t[common] == tables[0][common] for t in tables) and (
        common + 1
    ) * size < min(kv_lengths):
        common += 1
    if common == 0:
        raise ValueError(f"requests {rids} share no block: their attention has no shared prefix")
    prefix = torch.tensor(tables[0][:common], dtype=torch.long, device=device)
    prefix_rows = (prefix[:, None] * size + torch.arange(size, device=device)).flatten()
    width = max(kv_lengths) - common * size
    pos = common * size + torch.arange(width, device=device)  # (S_max,) positions after the prefix
    used = pos < torch.tensor(kv_lengths, device=device)[:, None]  # (Q, S_max)
    table = torch.tensor(
        [t + [0] * (max(map(len, tables)) - len(t)) for t in tables],
        dtype=torch.long,
        device=device,
    )
    rows = (
        table.gather(1, (pos // size).expand(len(rids), -1).clamp_max(table.shape[1] - 1)) * size
        + pos % size
    )
    return SharedPrefixPlan(prefix_rows, torch.where(used, rows, 0), used)


def shared_prefix_attention(q, cache, layer, plan, scale=None):
    """Decoding attention of Q requests sharing a prefix: q (Q, H, D), one
    query each, against their keys in ``cache``'s layer ``layer``, read as
    ``plan`` says. The prefix's keys, read once, meet all Q queries in one
    call; each request's suffix its own; merged by ``_merge_by_lse``.
    Returns (Q, H, D), equal to attention over each request's whole rows."""
    n, heads, dim = q.shape
    k, v = cache.k[layer], cache.v[layer]  # (rows, H_kv, D)
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # the prefix: every query of a key/value head's group, all requests, one call
    kp, vp = (t.index_select(0, plan.prefix_rows).transpose(0, 1) for t in (k, v))  # (H_kv, L, D)
    qp = q.view(n, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, n * group, dim)
    out_p, lse_p = _attention_lse(
        qp, kp, vp, scale=scale
    )  # (H_kv, Q * group, D), (H_kv, Q * group)
    out_p = out_p.view(kv_heads, n, group, dim).permute(1, 0, 2, 3)  # (Q, H_kv, group, D)
    lse_p = lse_p.view(kv_heads, n, group).permute(1, 0, 2)
    # each request's own keys after the prefix, padded
    ks, vs = (
        t.index_select(0, plan.suffix_rows.flatten()).view(n, -1, kv_heads, dim).transpose(1, 2)
        for t in (k, v)
    )  # (Q, H_kv, S_max, D)
    out_s, lse_s = _attention_lse(
        q.view(n, kv_heads, group, dim),
        ks,
        vs,
        mask=plan.suffix_used[:, None, None, :],
        scale=scale,
    )
    return _merge_by_lse(out_p, lse_p, out_s, lse_s).reshape(n, heads, dim)
