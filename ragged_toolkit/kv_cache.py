"""A KV cache for a ragged batch, a packed prefill into it, and greedy
decoding from it: one generation path, whose decoding steps read the cache
either through ``ragged_attention`` with the rows in use (``kv_used``) or
with fixed shapes that one compiled graph serves (:class:`CachedStep`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .batches import offsets_from_lengths, token_index
from .device import default_dtype
from .gpt import Packed


class KVCache:
    """Keys and values of every layer for ``batch`` sequences with room for
    ``capacity`` tokens each: (layers, batch, capacity, H_kv, D)."""

    def __init__(self, cfg, batch, capacity, device, dtype):
        shape = (cfg.n_layers, batch, capacity, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        # seen as packed rows (batch * capacity, H_kv, D), sequence b owns rows
        # b * capacity ... (b + 1) * capacity - 1: these are its kv_offsets
        self.row_offsets = torch.arange(batch + 1, device=device) * capacity

    def write_rows(self, layer, k, v, rows):
        """Packed new keys (T, H_kv, D) into their rows; returns all rows."""
        k_all, v_all = self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)
        k_all.index_copy_(0, rows, k.to(k_all.dtype))  # autocast may hand us float32
        v_all.index_copy_(0, rows, v.to(v_all.dtype))
        return k_all, v_all

    def write_columns(self, layer, k, v, start):
        """Padded new keys (B, S, H_kv, D) into columns ``start ...``; returns
        every column up to the last one written."""
        end = start + k.shape[1]
        self.k[layer, :, start:end], self.v[layer, :, start:end] = k, v
        return self.k[layer, :, :end], self.v[layer, :, :end]


@dataclass
class CachedStep:
    """One new token for each of B sequences against a :class:`KVCache` of
    fixed capacity, in the style of gpt-fast: the slot each sequence's new
    keys go to is a tensor (``slots``, (B,)), and so is the first slot in
    use (``start``, (B,); left padding, or ``None`` for slot 0). Every shape
    is fixed, so one compiled graph serves every step, with no host sync.
    The kernel scores every slot of the cache and masks those not in use."""

    cache: KVCache
    slots: torch.Tensor  # (B,)
    start: torch.Tensor | None = None  # (B,)

    def attend(self, q, k, v, layer):  # (B, H, D), (B, H_kv, D)
        keys, values = self.cache.k[layer], self.cache.v[layer]  # (B, C, H_kv, D)
        batch = torch.arange(len(q), device=q.device)
        keys[batch, self.slots] = k.to(keys.dtype)
        values[batch, self.slots] = v.to(values.dtype)
        slot = torch.arange(self.cache.capacity, device=q.device)
        mask = slot <= self.slots[:, None]  # (B, C)
        if self.start is not None:
            mask = mask & (slot >= self.start[:, None])
        out = F.scaled_dot_product_attention(
            q[:, :, None].to(keys.dtype),  # (B, H, 1, D)
            keys.transpose(1, 2),  # (B, H_kv, C, D)
            values.transpose(1, 2),
            attn_mask=mask[:, None, None],
            enable_gqa=q.shape[1] != keys.shape[2],
        )
        return out[:, :, 0]  # (B, H, D)


def call_model(model, tokens, positions, layout):
    """``model(tokens, positions, layout)``: the decoding step to compile."""
    return model(tokens, positions, layout)


@torch.no_grad()
def prefill_packed(model, prompts, offsets, cache, backend=None):
    """Every prompt at once, packed (T,) with offsets (B + 1,): writes each
    token's keys and values into its sequence's rows of ``cache`` and returns
    the logits of each prompt's last token, (B, vocab). Call it under
    autocast for a lower precision."""
    seq, pos = token_index(offsets)
    layout = Packed(offsets, backend, cache, seq * cache.capacity + pos, offsets.diff())
    return model(prompts, pos, layout)[offsets[1:] - 1]


@torch.no_grad()
def decode_greedy(model, logits, cache, positions, n_new, *, fixed_shape=True, backend=None, slots=None,
                  start=None, step=None, return_logits=False):
    """``n_new`` greedy tokens per sequence from the prefill's last logits
    (B, vocab): each step feeds one token per sequence at its own position
    (``positions``, (B,), the prompt lengths). ``fixed_shape``: a
    :class:`CachedStep` (``slots`` (B,) is where the first new token's keys
    go, default its position; ``start`` the first slot in use, for left
    padding); else a :class:`~ragged_toolkit.gpt.Packed` step through
    ``ragged_attention`` with ``backend``, over each sequence's rows in use.
    ``step(model, tokens, positions, layout)`` runs the model, for example
    ``torch.compile(call_model, dynamic=False)`` (default: :func:`call_model`).
    Returns the new tokens (B, n_new), and with ``return_logits`` the logits
    that chose them, (B, n_new, vocab)."""
    step = call_model if step is None else step
    slots = positions if slots is None else slots
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
            layout = Packed(one_each, backend, cache, cache.row_offsets[:-1] + slots + i, slots + i + 1)
        logits = step(model, out[-1], positions + i, layout)
    return (torch.stack(out, 1), torch.stack(chose, 1)) if return_logits else torch.stack(out, 1)


@torch.no_grad()
def generate_packed(model, prompts, offsets, n_new, backend=None, *, fixed_shape=False, step=None,
                    dtype=None, return_logits=False):
    """Greedy generation for packed prompts (T,) with offsets (B + 1,):
    :func:`prefill_packed` with ``backend``, then :func:`decode_greedy` with
    the same backend or, ``fixed_shape=True``, with :class:`CachedStep` steps.
    ``dtype`` (default: ``default_dtype`` of the prompts' device) other than
    float32 runs under autocast. Returns the new tokens, (B, n_new) (and with
    ``return_logits`` the logits that chose them, (B, n_new, vocab))."""
    dtype = default_dtype(prompts.device) if dtype is None else dtype
    lengths = offsets.diff()
    cache = KVCache(model.cfg, len(lengths), int(lengths.max()) + n_new, prompts.device, dtype)
    with torch.autocast(prompts.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = prefill_packed(model, prompts, offsets, cache, backend)
        return decode_greedy(model, logits, cache, lengths, n_new, fixed_shape=fixed_shape, backend=backend,
                             step=step, return_logits=return_logits)


@torch.no_grad()
def teacher_forced_logits(model, prompts, offsets, new_tokens, backend="loop"):
    """The reference for a greedy generation: each prompt followed by the
    tokens generated for it (``new_tokens``, (B, n_new)), run through the
    model once, packed, with no cache. Returns the logits that chose each new
    token, (B, n_new, vocab), in float32: a generation's own logits must
    match them within the dtype's tolerance, however rounding breaks a near
    tie (the next tokens are fed, not re-chosen)."""
    lengths, n_new = offsets.diff(), new_tokens.shape[1]
    pieces = [torch.cat([prompts[int(a):int(b)], t[:-1]]) for a, b, t in zip(offsets[:-1], offsets[1:], new_tokens)]
    full = offsets_from_lengths(lengths + n_new - 1, prompts.device)
    logits = model(torch.cat(pieces), token_index(full)[1], Packed(full, backend))  # (T, vocab)
    rows = full[:-1, None] + lengths[:, None] - 1 + torch.arange(n_new, device=prompts.device)  # (B, n_new)
    return logits[rows].float()
