"""A small hybrid decoder, as Qwen3-Next and the other hybrids stack them:
the site's :class:`~ragged_toolkit.gpt.GPT` with a recurrent token mixer
(:mod:`ragged_toolkit.recurrent`) in place of attention in most blocks and
full attention in one block of every ``attention_every``. It runs on a
packed batch (a :class:`~ragged_toolkit.layouts.PackedLayout`, whose plan
holds the offsets that the recurrent layers reset at) or on right-padded
rows (a :class:`~ragged_toolkit.layouts.PaddedLayout` without a mask)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .batches import to_padded, token_index
from .data import document_targets
from .gpt import GPT, FeedForward
from .layouts import PackedLayout, PaddedLayout
from .recurrent import GatedDeltaLayer

__all__ = ["RecurrentBlock", "HybridGPT", "hybrid_loss"]


class RecurrentBlock(nn.Module):
    """A pre-norm decoder block whose token mixer is a recurrent layer:
    RMSNorm, ``mixer``, residual; RMSNorm, ``FeedForward``,
    residual. Called as a :class:`~ragged_toolkit.gpt.Block` is, ``(x, cos,
    sin, layout)``: x (T, dim) packed or (B, S, dim) right-padded; the
    rotary angles are not used (the recurrence is ordered by itself)."""

    def __init__(self, cfg, mixer):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.mixer, self.ffn = mixer, FeedForward(cfg)

    def forward(self, x, cos, sin, layout):
        if isinstance(layout, PackedLayout) and layout.cache is None:
            offsets = layout.plan.q_offsets  # (B + 1,): the state is reset at each document
        elif isinstance(layout, PaddedLayout) and layout.mask is None and layout.cache is None:
            offsets = None  # right-padded rows, one document each
        else:
            raise ValueError(
                f"a recurrent block takes a packed batch (PackedLayout) or right-padded rows "
                f"(PaddedLayout without a mask), without a KV cache; got {layout!r}. To decode, "
                f"use the mixer's prefill and step"
            )
        x = x + self.mixer(self.attn_norm(x), offsets)
        return x + self.ffn(self.ffn_norm(x))


class HybridGPT(GPT):
    """:class:`~ragged_toolkit.gpt.GPT` with full attention in one block of
    every ``attention_every`` (the last of each group, as Qwen3-Next's
    ``layer_types``) and a ``mixer`` layer (default
    :class:`~ragged_toolkit.recurrent.GatedDeltaLayer`, ``cfg.n_heads`` value
    heads sharing ``cfg.n_kv_heads`` q/k heads of ``cfg.head_dim``, chunks of
    ``chunk`` tokens) in the others. ``forward(tokens, positions, layout)``
    as the GPT's; ``attention_layers`` lists the blocks that attend."""

    def __init__(self, cfg, *, attention_every=4, mixer=GatedDeltaLayer, chunk=64):
        super().__init__(cfg)
        self.attention_layers = [i for i in range(cfg.n_layers) if (i + 1) % attention_every == 0]
        for i in range(cfg.n_layers):
            if i not in self.attention_layers:
                self.layers[i] = RecurrentBlock(
                    cfg,
                    mixer(
                        cfg.dim, cfg.n_heads, cfg.head_dim, key_heads=cfg.n_kv_heads, chunk=chunk
                    ),
                )


def hybrid_loss(model, tokens, offsets, *, padded=False, dtype=torch.float32):
    """The mean next-token loss of a packed batch, tokens (T,) and offsets
    (B + 1,), each token predicting the next one of its own document: run
    packed (a :class:`~ragged_toolkit.layouts.PackedLayout`), or with
    ``padded`` right-padded to (B, S_max) (a ``PaddedLayout``, the padding's
    targets ignored); under autocast to ``dtype`` unless float32."""
    targets = document_targets(tokens, offsets)  # (T,), -100 at each document's last token
    with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype != torch.float32):
        if padded:
            tokens, targets = (
                to_padded(tokens, offsets)[0],
                to_padded(targets, offsets, -100)[0],
            )  # (B, S)
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            logits = model(tokens, positions, PaddedLayout())  # (B, S, vocab)
        else:
            logits = model(
                tokens, token_index(offsets, len(tokens))[1], PackedLayout.of(offsets, dtype=dtype)
            )
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
