"""What ``ragged_attention`` reads from a batch's offsets, once per batch:
its lengths, checked, on the host; and what a backend prepares for the batch
(index tensors, masks), kept with it so that every layer of a model shares it."""

from dataclasses import dataclass, field

import numpy as np
import torch

from ..batches import check_offsets


@dataclass
class BatchPlan:
    """The lengths of one batch, read from its offsets once, on the host, and
    what backends prepared for it."""

    q_lengths: list  # queries per sequence
    kv_lengths: list  # keys each sequence uses (``kv_used``, or all of its rows)
    kv_rows: list  # key rows each sequence has in the packed tensor
    prepared: dict = field(default_factory=dict)  # what a backend built, by its key

    @property
    def has_empty(self):
        """Whether some sequence has no queries or no keys in use."""
        return not (all(self.q_lengths) and all(self.kv_lengths))


_RECENT = []  # the last few batches; holding their tensors keeps the ids unique


def _once_per_batch(key, compute):
    # ``compute()`` once per tuple of tensors (by identity and version) and sizes
    stamp = tuple(t._version if isinstance(t, torch.Tensor) else t for t in key)
    for cached_key, cached_stamp, value in _RECENT:
        if cached_stamp == stamp and all(
            a is b for a, b in zip(cached_key, key) if isinstance(a, torch.Tensor) or a is None
        ):
            return value
    value = compute()
    _RECENT.insert(0, (key, stamp, value))
    del _RECENT[16:]
    return value


def _lengths(q_offsets, kv_offsets, n_q, n_kv):
    check_offsets(q_offsets, n_q, "q_offsets")
    check_offsets(kv_offsets, n_kv, "kv_offsets")
    if len(q_offsets) != len(kv_offsets):
        raise ValueError(
            f"q_offsets and kv_offsets describe different batch sizes: "
            f"{len(q_offsets) - 1} and {len(kv_offsets) - 1} sequences"
        )
    return q_offsets.diff().tolist(), kv_offsets.diff().tolist()


def plan_batch(q_offsets, kv_offsets, n_q, n_kv, kv_used=None, is_causal=False):
    """Check a batch's description and read its lengths, once per batch (the
    offsets once, however often ``kv_used`` changes, as in decoding).
    Returns a :class:`BatchPlan`."""

    def compute():
        q_lengths, kv_rows = _once_per_batch(
            (q_offsets, kv_offsets, n_q, n_kv),
            lambda: _lengths(q_offsets, kv_offsets, n_q, n_kv),
        )
        kv_lengths = kv_rows if kv_used is None else kv_used.tolist()
        if len(kv_lengths) != len(kv_rows) or any(
            not 0 <= n <= r for n, r in zip(kv_lengths, kv_rows)
        ):
            raise ValueError(
                f"kv_used must hold one count per sequence, between 0 and its key "
                f"rows {kv_rows}; got {kv_lengths}"
            )
        if is_causal and any(0 < lkv < lq for lq, lkv in zip(q_lengths, kv_lengths)):
            raise ValueError(
                "is_causal needs at least as many keys as queries in every sequence "
                "(the last query sees every key)"
            )
        return BatchPlan(q_lengths, kv_lengths, kv_rows)

    return _once_per_batch((q_offsets, kv_offsets, kv_used, n_q, n_kv, is_causal), compute)


def without_empty_sequences(plan, device):
    """The rows of the sequences that have queries and keys in use: query rows
    (T_q',), key rows (T_kv',) (only those in use), and the smaller batch's
    :class:`BatchPlan`."""
    keep = [i for i, (lq, lkv) in enumerate(zip(plan.q_lengths, plan.kv_lengths)) if lq and lkv]
    q_start = np.cumsum([0] + plan.q_lengths)
    kv_start = np.cumsum([0] + plan.kv_rows)
    q_rows = [np.arange(q_start[i], q_start[i] + plan.q_lengths[i]) for i in keep]
    kv_rows = [np.arange(kv_start[i], kv_start[i] + plan.kv_lengths[i]) for i in keep]
    used = [plan.kv_lengths[i] for i in keep]
    return (
        torch.as_tensor(np.concatenate(q_rows or [[]]), dtype=torch.long, device=device),
        torch.as_tensor(np.concatenate(kv_rows or [[]]), dtype=torch.long, device=device),
        BatchPlan([plan.q_lengths[i] for i in keep], used, used),
    )
