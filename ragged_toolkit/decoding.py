"""A packed prefill into a :class:`~ragged_toolkit.kv_cache.KVCache` and
greedy decoding from it: one generation path, whose decoding steps read the
cache either through ``ragged_attention`` with the rows in use
(``kv_used``) or with fixed shapes that one compiled graph serves
(``CachedStep``); and the teacher-forced
logits a generation is proved against."""

from __future__ import annotations

import torch

from .attention import default_backend, plan_batch
from .batches import token_index
from .device import default_dtype
from .kv_cache import CachedStep, KVCache
from .layouts import PackedLayout

__all__ = ["prefill_packed", "decode_greedy", "generate_packed"]


def _call_model(model, tokens, positions, layout):
    """``model(tokens, positions, layout)``: the decoding step to compile."""
    return model(tokens, positions, layout)


@torch.no_grad()
def prefill_packed(model, prompts, offsets, cache, backend=None, *, flex=None):
    """Every prompt at once, packed (T,) with offsets (B + 1,): writes each
    token's keys and values into its sequence's rows of ``cache`` and returns
    the logits of each prompt's last token, (B, vocab). Call it under
    autocast for a lower precision. ``flex``: the caller's
    :class:`~ragged_toolkit.attention.flex.FlexKernel`, for ``backend="flex"``."""
    backend = default_backend(prompts.device, cache.k.dtype) if backend is None else backend
    seq, pos = token_index(offsets)
    plan = plan_batch(
        offsets,
        cache.row_offsets,
        backend=backend,
        is_causal=True,
        kv_used=offsets.diff(),
        flex=flex,
    )
    layout = PackedLayout(plan, cache, seq * cache.capacity + pos)
    return model(prompts, pos, layout)[offsets[1:] - 1]


@torch.no_grad()
def decode_greedy(
    model,
    logits,
    cache,
    positions,
    n_new,
    *,
    fixed_shape=True,
    backend=None,
    flex=None,
    slots=None,
    start=None,
    step=None,
    return_logits=False,
):
    """``n_new`` greedy tokens per sequence from the prefill's last logits
    (B, vocab): each step feeds one token per sequence at its own position
    (``positions``, (B,), the prompt lengths). ``fixed_shape``: a
    ``CachedStep`` (``slots`` (B,) is where the first new token's keys
    go, default its position; ``start`` the first slot in use, for left
    padding); else a ``PackedLayout`` step through
    ``ragged_attention`` with ``backend`` (and ``flex``, its kernel, for
    ``flex``), over each sequence's rows in use.
    ``step(model, tokens, positions, layout)`` runs the model (default: a
    plain call; a compiled one, ``torch.compile(step, dynamic=False)``, serves
    every fixed-shape step with one graph).
    Returns the new tokens (B, n_new), and with ``return_logits`` the logits
    that chose them, (B, n_new, vocab)."""
    step = _call_model if step is None else step
    slots = positions if slots is None else slots
    backend = default_backend(positions.device, cache.k.dtype) if backend is None else backend
    one_each = torch.arange(len(positions) + 1, device=positions.device)  # one query per sequence
    out, chose = [], []
    for i in range(n_new):
        out.append(logits.argmax(-1))  # (B,)
        chose.append(logits)
        if i == n_new - 1:
            break
        if fixed_shape:
            layout = CachedStep(cache, slots + i, start)
        else:  # each token's row, and the keys its sequence then has
            plan = plan_batch(
                one_each,
                cache.row_offsets,
                backend=backend,
                is_causal=True,
                kv_used=slots + i + 1,
                flex=flex,
            )
            layout = PackedLayout(plan, cache, cache.row_offsets[:-1] + slots + i)
        logits = step(model, out[-1], positions + i, layout)
    return (torch.stack(out, 1), torch.stack(chose, 1)) if return_logits else torch.stack(out, 1)


@torch.no_grad()
def generate_packed(
    model,
    prompts,
    offsets,
    n_new,
    backend=None,
    *,
    fixed_shape=False,
    flex=None,
    step=None,
    dtype=None,
    return_logits=False,
):
    """Greedy generation for packed prompts (T,) with offsets (B + 1,):
    :func:`prefill_packed` with ``backend`` (``flex``: its kernel, for
    ``flex``), then :func:`decode_greedy` with
    the same backend or, ``fixed_shape=True``, with ``CachedStep`` steps.
    ``dtype`` (default: ``default_dtype`` of the prompts' device) other than
    float32 runs under autocast. Returns the new tokens, (B, n_new) (and with
    ``return_logits`` the logits that chose them, (B, n_new, vocab))."""
    dtype = default_dtype(prompts.device) if dtype is None else dtype
    lengths = offsets.diff()
    cache = KVCache(model.cfg, len(lengths), int(lengths.max()) + n_new, prompts.device, dtype)
    with torch.autocast(prompts.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = prefill_packed(model, prompts, offsets, cache, backend, flex=flex)
        return decode_greedy(
            model,
            logits,
            cache,
            lengths,
            n_new,
            fixed_shape=fixed_shape,
            backend=backend,
            flex=flex,
            step=step,
            return_logits=return_logits,
        )
