"""Qwen3-Next in ``transformers`` on packed rows: its Gated DeltaNet layers
swapped for :class:`~ragged_toolkit.recurrent.GatedDeltaLayer` with the
same weights, which keeps the documents of a row apart.

A packed row is ``input_ids`` (1, T) with ``position_ids`` (1, T) that
restart at 0 at every document (what ``DataCollatorWithFlattening`` gives);
its boundaries reach the linear-attention layers only as the keyword
arguments ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (B + 1,) int32, which the
collator adds with ``return_flash_attn_kwargs=True`` and ``packed_kwargs``
makes from offsets. Its decoder layers pass them on to the linear-attention
layers from ``transformers`` 5.9.0 on (:data:`FORWARDS_CU_SEQ_LENS`); before,
the swapped layers would see one document per row, so
:func:`swap_gated_delta_layers` refuses those releases. ``transformers`` is
imported by the functions that need it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .recurrent import GatedDeltaLayer

__all__ = [
    "FORWARDS_CU_SEQ_LENS",
    "forwards_cu_seq_lens",
    "PackedGatedDeltaNet",
    "swap_gated_delta_layers",
    "packed_kwargs",
]

#: The first ``transformers`` release whose Qwen3-Next decoder layers pass the
#: boundary keywords (``cu_seq_lens_q``) on to ``linear_attn`` (5.8.1 does not).
FORWARDS_CU_SEQ_LENS = "5.9.0"


def _release(version):
    """'5.23.0' -> (5, 23, 0); a local or pre-release suffix is ignored."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())


def forwards_cu_seq_lens():
    """Whether the installed ``transformers`` passes a packed row's
    boundaries on to Qwen3-Next's linear-attention layers
    (:data:`FORWARDS_CU_SEQ_LENS` or later): what the swapped layers need."""
    import transformers

    return _release(transformers.__version__) >= _release(FORWARDS_CU_SEQ_LENS)


@torch.no_grad()
def _gated_delta_from_qwen3_next(hf, chunk=64):
    """A :class:`~ragged_toolkit.recurrent.GatedDeltaLayer` with the weights of ``hf``, a
    ``Qwen3NextGatedDeltaNet``. ``in_proj_qkvz`` holds, for each of the Hk
    q/k heads, its q (K), k (K), v (r V) and z (r V) rows, r = Hv / Hk;
    ``in_proj_ba`` its b (r) and a (r) rows. They are regrouped as
    ``qkv_proj`` (all q, all k, all v: the order of ``conv1d``'s channels),
    ``gate_proj`` (z) and ``ab_proj`` (a, b); the rest is copied as is."""
    Hk, Hv, K, V = hf.num_k_heads, hf.num_v_heads, hf.head_k_dim, hf.head_v_dim
    if K != V or hf.activation != "silu":
        raise ValueError(
            f"GatedDeltaLayer has one head size and SiLU; this layer has K {K}, V {V}, "
            f"{hf.activation}"
        )
    weight = hf.in_proj_qkvz.weight
    layer = GatedDeltaLayer(
        hf.hidden_size,
        Hv,
        V,
        key_heads=Hk,
        conv_width=hf.conv_kernel_size,
        chunk=chunk,
        eps=hf.layer_norm_epsilon,
        device=weight.device,
        dtype=weight.dtype,
    )
    r = Hv // Hk
    q, k, v, z = weight.unflatten(0, (Hk, -1)).split([K, K, r * V, r * V], 1)  # (Hk, rows, E) each
    b, a = hf.in_proj_ba.weight.unflatten(0, (Hk, -1)).split([r, r], 1)  # (Hk, r, E) each
    layer.qkv_proj.weight.copy_(torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)]))
    layer.gate_proj.weight.copy_(z.flatten(0, 1))
    layer.ab_proj.weight.copy_(torch.cat([a.flatten(0, 1), b.flatten(0, 1)]))
    layer.conv_weight.copy_(hf.conv1d.weight[:, 0])  # (channels, 1, W) -> (channels, W)
    for mine, theirs in (
        (layer.A_log, hf.A_log),
        (layer.dt_bias, hf.dt_bias),
        (layer.norm_weight, hf.norm.weight),
        (layer.out_proj.weight, hf.out_proj.weight),
    ):
        mine.copy_(theirs)
    return layer


class PackedGatedDeltaNet(nn.Module):
    """Stands in for a ``Qwen3NextGatedDeltaNet`` in its decoder layer, called
    as it is: hidden states (B, L, E) -> (B, L, E). Reads the documents from
    ``cu_seq_lens_q`` (offsets over the B * L tokens); without it each row is
    one document. Training and prefill only: it refuses a cache
    (``use_cache=False``) and a padding mask."""

    def __init__(self, hf, chunk=64):
        super().__init__()
        self.layer = _gated_delta_from_qwen3_next(hf, chunk)
        self.layer_idx = hf.layer_idx

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if cache_params is not None:
            raise ValueError(
                "PackedGatedDeltaNet keeps no cache: call the model with use_cache=False"
            )
        if attention_mask is not None:
            raise ValueError("PackedGatedDeltaNet takes packed rows, not a padding mask")
        B, L, E = hidden_states.shape
        offsets = kwargs.get("cu_seq_lens_q")
        offsets = (
            torch.arange(B + 1, device=hidden_states.device) * L
            if offsets is None
            else offsets.to(hidden_states.device, torch.long)
        )
        return self.layer(hidden_states.reshape(B * L, E), offsets).view(B, L, E)


def swap_gated_delta_layers(model, chunk=64):
    """Replace, in place, every ``linear_attn`` of a Qwen3-Next model (a
    ``Qwen3NextForCausalLM`` or its ``.model``) by a :class:`PackedGatedDeltaNet`
    with its weights. Returns the model and how many layers were swapped.
    Raises ``RuntimeError`` on a release older than :data:`FORWARDS_CU_SEQ_LENS`."""
    import transformers

    if not forwards_cu_seq_lens():
        raise RuntimeError(
            f"transformers {transformers.__version__} does not pass a packed row's boundaries "
            f"(cu_seq_lens_q) to its linear-attention layers, so the swapped layers could not "
            f"keep documents apart: upgrade to transformers {FORWARDS_CU_SEQ_LENS} or later"
        )
    decoder = getattr(model, "model", model)
    swapped = 0
    for block in decoder.layers:
        if hasattr(block, "linear_attn"):
            block.linear_attn = PackedGatedDeltaNet(block.linear_attn, chunk)
            swapped += 1
    return model, swapped


def packed_kwargs(offsets):
    """The boundary keyword arguments of a packed row, as
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives them:
    offsets (B + 1,) -> ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k``."""
    cu, longest = offsets.to(torch.int32), int(offsets.diff().max())
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }
