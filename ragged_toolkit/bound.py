"""The work bound: what padding adds in work, which a speedup is printed beside."""

import torch

from .measure import outside_noise


def pairs_scored(q_lengths, kv_lengths, causal):
    """Query-key pairs a kernel scores: the causal half, L(L+1)/2 per sequence,
    when it skips the masked half, else every pair."""
    q, kv = torch.as_tensor(q_lengths).double(), torch.as_tensor(kv_lengths).double()
    return float((q * (q + 1) / 2 if causal else q * kv).sum())


def work_bound(q_lengths, kv_lengths=None, *, per_token, per_pair, per_kv_token=0.0, causal=False,
               padded_causal=None):
    """The work of the padded batch over the work of the ragged batch.
    ``padded_causal``: whether the padded side skips the masked half of the
    scores (a causal kernel) or computes the whole square (a merged mask)."""
    q = torch.as_tensor(q_lengths)
    kv = q if kv_lengths is None else torch.as_tensor(kv_lengths)
    padded_causal = causal if padded_causal is None else padded_causal

    def work(ql, kvl, c):
        return (per_token * float(ql.sum()) + per_kv_token * float(kvl.sum())
                + per_pair * pairs_scored(ql, kvl, c))

    full_q, full_kv = torch.full_like(q, int(q.max())), torch.full_like(kv, int(kv.max()))
    return work(full_q, full_kv, padded_causal) / work(q, kv, causal)


def training_work(lengths, per_token, per_pair, padded_causal=True, padded_lengths=None):
    """The work of training steps, one per batch of ``lengths`` (each (B,)):
    ``per_token`` per token and ``per_pair`` per query-key pair scored,
    packed (causal) and padded to each batch's longest (causal where
    ``padded_causal``, a causal kernel; every pair where not, a mask).
    ``padded_lengths``: the padded side's own batches, where they hold other
    documents (a length-grouped baseline). Returns ``(packed, padded)``;
    their ratio is the work bound."""
    packed = padded = 0.0
    for n in lengths:
        packed += per_token * float(n.sum()) + per_pair * pairs_scored(n, n, True)
    for n in lengths if padded_lengths is None else padded_lengths:
        longest = torch.full_like(n, int(n.max()))
        padded += per_token * float(longest.sum()) + per_pair * pairs_scored(longest, longest, padded_causal)
    return packed, padded


def speedup_line(label, padded, ragged, bound):
    """The speedup of ``ragged`` over ``padded`` (two Timings), beside the work
    bound; "(within noise)" where their interquartile ranges overlap."""
    s = padded.median_ms / ragged.median_ms
    noise = "" if outside_noise(padded, ragged) else " (within noise)"
    return f"{label}: speedup {s:.2f}x, work bound {bound:.2f}x, fraction of bound {s / bound:.2f}{noise}"
