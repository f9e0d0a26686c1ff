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


def work_per_token(batches, per_token, per_pair, *, padded=False, causal=True):
    """The work of training steps per real token: one step per entry of
    ``batches`` (each a (B,) tensor of sequence lengths), ``per_token`` per
    token and ``per_pair`` per query-key pair scored. Packed (``padded``
    False), each sequence as it is, its causal half; padded, each batch
    padded to its longest sequence, the causal half where ``causal`` (a
    causal kernel), else every pair (a merged mask). Two trainers' work per
    token, divided, is the work bound of their tokens per second, even when
    they batch other documents (a length-grouped baseline)."""
    work = tokens = 0.0
    for n in batches:
        if padded:  # every sequence as long as the longest; the causal half only with a causal kernel
            n_padded = torch.full_like(n, int(n.max()))
            work += per_token * float(n_padded.sum()) + per_pair * pairs_scored(n_padded, n_padded, causal)
        else:  # the causal half of each sequence
            work += per_token * float(n.sum()) + per_pair * pairs_scored(n, n, True)
        tokens += float(n.sum())
    return work / tokens


def speedup_line(label, padded, ragged, bound):
    """The speedup of ``ragged`` over ``padded`` (two Timings), beside the work
    bound; "(within noise)" where their interquartile ranges overlap."""
    s = padded.median_ms / ragged.median_ms
    noise = "" if outside_noise(padded, ragged) else " (within noise)"
    return f"{label}: speedup {s:.2f}x, work bound {bound:.2f}x, fraction of bound {s / bound:.2f}{noise}"
