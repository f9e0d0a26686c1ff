"""One step of the engine: each request of the step's work fed its next
tokens (a prompt chunk, or the token it generated last), packed into one
forward pass over the paged cache: prefill, decoding and recomputation are
one operation."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..attention import default_backend
from ..batches import offsets_from_lengths, token_index
from ..kv_cache import block_table_tensor
from .paged_attention import PagedLayout, prepare_paged
from .requests import next_tokens

__all__ = ["step_logits"]


def build_step(cache, work, device, path="gathered", backend=None, *, flex=None):
    """The tokens (T,), positions (T,) and
    :class:`~ragged_toolkit.serving.paged_attention.PagedLayout` of a step
    that feeds each ``(request, n)`` of ``work`` its next ``n`` tokens, into
    rows already reserved. ``n = 0``: an idle slot, one padding token at the
    request's next position, whose key nothing reads. Positions and cache
    rows come from tensor operations over the step's offsets and block
    table; only the token ids are read per request. What ``path`` reads the
    cache with is built here, once for every layer (``prepare_paged``; the
    gathered path's plan on ``backend``, default ``default_backend``).
    ``flex``: the caller's
    :class:`~ragged_toolkit.attention.flex.FlexKernel`, which the ``flex``
    path and the flex backend run outside ``torch.compile``."""
    for req, n in work:
        cache.check_writable(req.rid, req.computed, req.computed + max(n, 1))
    tokens = [t for req, n in work for t in (next_tokens(req, req.computed, n) if n else [0])]
    starts = torch.tensor(
        [req.computed for req, _ in work], device=device
    )  # (B,) keys cached before
    q_lengths = [max(n, 1) for _, n in work]  # an idle slot feeds one padding token
    q_offsets = offsets_from_lengths(q_lengths, device)  # (B + 1,)
    seq, step_position = token_index(q_offsets)  # (T,) each token's request, its place in the step
    positions = starts[seq] + step_position  # (T,) its place in its request's history
    block_table = block_table_tensor(cache, [r.rid for r, _ in work], device)  # (B, max_blocks)
    size = cache.block_size
    slots = block_table[seq, positions // size].long() * size + positions % size  # (T,) cache rows
    kv_lengths = starts + torch.tensor(q_lengths, device=device)  # (B,) keys in use after the step
    layout = PagedLayout(
        cache,
        q_offsets,
        slots,
        positions,
        kv_lengths,
        block_table,
        max(q_lengths),
        max(r.computed + m for (r, _), m in zip(work, q_lengths)),
        path,
        flex,
    )
    backend = default_backend(device, cache.k.dtype) if backend is None else backend
    layout = replace(layout, prepared=prepare_paged(layout, backend))
    return torch.tensor(tokens, dtype=torch.long, device=device), positions, layout


@torch.no_grad()
def step_logits(model, cache, work, path="gathered", backend=None, *, flex=None):
    """One forward pass over the packed tokens of ``work``, a list of
    ``(request, n)``, their keys written into ``cache``: the logits (B,
    vocab) after each request's last new token. Changes no request."""
    tokens, positions, layout = build_step(cache, work, cache.k.device, path, backend, flex=flex)
    return model(tokens, positions, layout)[layout.q_offsets[1:] - 1]


@torch.no_grad()
def forward_step(model, cache, work, path="gathered", backend=None, on_token=None, *, flex=None):
    """One step over ``work``, a list of ``(request, n)``: each request
    whose history is then all in the cache gets its next token, the greedy
    choice of :func:`step_logits`. A request keeps its tokens, not the
    logits that chose them: ``on_token(request, logits)`` (vocab,), if
    given, sees those (a proof records them; a server need not)."""
    last = step_logits(model, cache, work, path, backend, flex=flex)  # (B, vocab)
    choices = last.argmax(-1).tolist()
    for i, (req, n) in enumerate(work):
        req.computed += n
        if n and req.pending() == 0:
            req.generated.append(choices[i])
            if on_token is not None:
                on_token(req, last[i])
