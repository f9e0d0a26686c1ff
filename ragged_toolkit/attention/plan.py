"""A batch's plan: what ``ragged_attention`` needs about a packed batch, read
from its offsets and built once, on the host, by a call the caller sees
(:func:`plan_batch`); the caller holds it and passes it to every attention
call of the batch, as FlexAttention's ``create_block_mask`` is used. Given
a plan, ``ragged_attention`` reads nothing back from the device, so a
compiled model that takes the plan compiles it into its graph."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..batches import check_offsets, offsets_from_lengths
from .flex import prepare_flex
from .njt import prepare_njt
from .padded import prepare_bucketed, prepare_padded
from .varlen import prepare_varlen, varlen_missing

__all__ = ["BACKENDS", "BatchPlan", "plan_batch"]

#: The names of ``ragged_attention``'s backends.
BACKENDS = ("varlen", "sdpa_njt", "flex", "loop", "bucketed", "padded")
# what each backend builds for a batch, once (the loop needs only the lengths)
_PREPARE = {
    "varlen": prepare_varlen,
    "sdpa_njt": prepare_njt,
    "flex": prepare_flex,
    "loop": lambda plan: None,
    "bucketed": prepare_bucketed,
    "padded": prepare_padded,
}


@dataclass(frozen=True)
class BatchPlan:
    """One batch as ``ragged_attention`` reads it: the backend that will run
    it, the offsets (B + 1,) on the device, the lengths as Python ints (read
    once, checked), the keys in use, and what the backend built for the
    batch (``prepared``: index tensors, a mask, a ``BlockMask``); for
    ``flex``, the caller's compiled kernel (``flex``). Where some
    sequences have no queries or no keys in use, or the backend cannot read
    ``kv_used`` itself, ``nonempty`` holds the rows of the others and their
    own plan. Frozen: a plan is built once, by :func:`plan_batch`, and
    only read after."""

    backend: str
    is_causal: bool
    q_offsets: torch.Tensor  # (B + 1,)
    kv_offsets: torch.Tensor  # (B + 1,)
    q_lengths: list  # queries per sequence
    kv_lengths: list  # keys each sequence uses (``kv_used``, or all of its rows)
    kv_rows: list  # key rows each sequence has in the packed tensor
    kv_used: torch.Tensor | None = None  # (B,), as given
    flex: object = None  # the FlexKernel that runs the flex backend outside torch.compile
    prepared: object = None
    nonempty: tuple | None = None  # (query rows (T_q',), key rows (T_kv',), their BatchPlan)

    max_q: int = field(init=False)  # the most queries of a sequence
    max_kv: int = field(init=False)  # the most key rows of a sequence
    n_q: int = field(init=False)  # query rows of the packed batch
    n_kv: int = field(init=False)  # key rows of the packed batch

    def __post_init__(self):  # (a frozen dataclass sets its derived fields this way)
        object.__setattr__(self, "max_q", max(self.q_lengths, default=0))
        object.__setattr__(self, "max_kv", max(self.kv_rows, default=0))
        object.__setattr__(self, "n_q", sum(self.q_lengths))
        object.__setattr__(self, "n_kv", sum(self.kv_rows))


def _reads_kv_used(backend):
    """Whether ``backend`` reads only each sequence's key rows in use
    (``kv_used``) by itself; the others get those rows gathered first."""
    return backend != "sdpa_njt" and (backend != "varlen" or not varlen_missing(["seqused_k"]))


def plan_batch(q_offsets, kv_offsets=None, *, backend, is_causal=False, kv_used=None, flex=None):
    """Check a batch's description, read its lengths and build what
    ``backend`` needs for it: call once per batch, outside a compiled
    region, and pass the result to every ``ragged_attention`` call of the
    batch. ``q_offsets``, ``kv_offsets`` (default: ``q_offsets``): (B + 1,);
    ``kv_used``: optional (B,), the key rows each sequence uses from its
    start; ``flex``: the :class:`~ragged_toolkit.attention.flex.FlexKernel`
    that runs the ``flex`` backend, built once by the caller (outside
    ``torch.compile``, where the model's graph compiles FlexAttention, it
    is needed; the other backends ignore it). Returns a
    :class:`BatchPlan`. Raises ``ValueError`` naming what is wrong."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    q_lengths, kv_rows = _lengths(q_offsets, kv_offsets)
    q_offsets, kv_offsets = q_offsets.long(), kv_offsets.long()
    kv_lengths = kv_rows if kv_used is None else kv_used.tolist()
    if len(kv_lengths) != len(kv_rows) or any(not 0 <= n <= r for n, r in zip(kv_lengths, kv_rows)):
        raise ValueError(
            f"kv_used must hold one count per sequence, between 0 and its key rows "
            f"{kv_rows}; got {kv_lengths}"
        )
    if is_causal and any(0 < lkv < lq for lq, lkv in zip(q_lengths, kv_lengths)):
        raise ValueError(
            "is_causal needs at least as many keys as queries in every sequence "
            "(the last query sees every key)"
        )
    plan = BatchPlan(
        backend, is_causal, q_offsets, kv_offsets, q_lengths, kv_lengths, kv_rows, kv_used, flex
    )
    empty = not (all(q_lengths) and all(kv_lengths))
    if empty or (kv_used is not None and not _reads_kv_used(backend)):
        return replace(plan, nonempty=_without_empty_sequences(plan))
    return replace(plan, prepared=_PREPARE[backend](plan))


def _lengths(q_offsets, kv_offsets):
    if not isinstance(q_offsets, torch.Tensor) or not isinstance(kv_offsets, torch.Tensor):
        raise ValueError("offsets must be tensors (B + 1,): build them with offsets_from_lengths")
    check_offsets(q_offsets, int(q_offsets[-1]) if len(q_offsets) else 0, "q_offsets")
    check_offsets(kv_offsets, int(kv_offsets[-1]) if len(kv_offsets) else 0, "kv_offsets")
    if len(q_offsets) != len(kv_offsets):
        raise ValueError(
            f"q_offsets and kv_offsets describe different batch sizes: "
            f"{len(q_offsets) - 1} and {len(kv_offsets) - 1} sequences"
        )
    return q_offsets.diff().tolist(), kv_offsets.diff().tolist()


def _without_empty_sequences(plan):
    # the rows of the sequences that have queries and keys in use: query rows
    # (T_q',), key rows in use (T_kv',), and the smaller batch's plan
    keep = [i for i, (lq, lkv) in enumerate(zip(plan.q_lengths, plan.kv_lengths)) if lq and lkv]
    q_start, kv_start = np.cumsum([0] + plan.q_lengths), np.cumsum([0] + plan.kv_rows)
    q_rows = [np.arange(q_start[i], q_start[i] + plan.q_lengths[i]) for i in keep]
    kv_rows = [np.arange(kv_start[i], kv_start[i] + plan.kv_lengths[i]) for i in keep]
    device = plan.q_offsets.device
    as_rows = lambda rows: torch.as_tensor(
        np.concatenate(rows or [[]]), dtype=torch.long, device=device
    )  # noqa: E731
    used = [plan.kv_lengths[i] for i in keep]
    kept = (
        plan_batch(
            offsets_from_lengths([plan.q_lengths[i] for i in keep], device),
            offsets_from_lengths(used, device),
            backend=plan.backend,
            is_causal=plan.is_causal,
            flex=plan.flex,
        )
        if keep
        else None
    )
    return as_rows(q_rows), as_rows(kv_rows), kept
