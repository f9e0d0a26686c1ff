"""One step of the engine: each request of the step's work fed its next
tokens (a prompt chunk, or the token it generated last), packed into one
forward pass over the paged cache: prefill, decoding and recomputation are
one operation."""

from __future__ import annotations

import torch

from ..attention import default_backend
from ..batches import offsets_from_lengths
from ..kv_cache import block_table_tensor
from .paged_attention import PagedLayout, prepare_paged

__all__ = ["build_step", "step_logits", "forward_step"]


def build_step(cache, work, device, path="gathered", backend=None):
    """The tokens (T,), positions (T,) and
    :class:`~ragged_toolkit.serving.paged_attention.PagedLayout` of a step
    that feeds each ``(request, n)`` of ``work`` its next ``n`` tokens, into
    rows already reserved. ``n = 0``: an idle slot, one padding token at the
    request's next position, whose key nothing reads. What ``path`` reads the
    cache with is built here, once for every layer (``prepare_paged``; the
    gathered path's plan on ``backend``, default ``default_backend``)."""
    tokens, positions, slots, q_lengths, kv_lengths = [], [], [], [], []
    for req, n in work:
        start, m = req.computed, max(n, 1)
        tokens += (req.prompt + req.generated)[start:start + n] if n else [0]
        positions += range(start, start + m)
        slots += cache.slots(req.rid, range(start, start + m))
        q_lengths.append(m)
        kv_lengths.append(start + m)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    layout = PagedLayout(cache, offsets_from_lengths(q_lengths, device), as_tensor(slots),
                         as_tensor(positions), as_tensor(kv_lengths),
                         block_table_tensor(cache, [r.rid for r, _ in work], device),
                         max(q_lengths), max(kv_lengths), path)
    backend = default_backend(device, cache.k.dtype) if backend is None else backend
    layout.prepared = prepare_paged(layout, backend)
    return as_tensor(tokens), layout.positions, layout


@torch.no_grad()
def step_logits(model, cache, work, path="gathered", backend=None):
    """One forward pass over the packed tokens of ``work``, a list of
    ``(request, n)``, their keys written into ``cache``: the logits (B,
    vocab) after each request's last new token. Changes no request."""
    tokens, positions, layout = build_step(cache, work, cache.k.device, path, backend)
    return model(tokens, positions, layout)[layout.q_offsets[1:] - 1]


@torch.no_grad()
def forward_step(model, cache, work, path="gathered", backend=None):
    """One step over ``work``, a list of ``(request, n)``: each request
    whose history is then all in the cache gets its next token, the greedy
    choice of :func:`step_logits`, and keeps the logits that chose it."""
    last = step_logits(model, cache, work, path, backend)  # (B, vocab)
    choices = last.argmax(-1).tolist()
    for i, (req, n) in enumerate(work):
        req.computed += n
        if n and req.pending() == 0:
            req.generated.append(choices[i])
            req.logits.append(last[i].float())
