"""``torch.nn``'s transformer as the reference of the library's
(:mod:`ragged_toolkit.layers`): its weights renamed for ours, and its calls
on padded tensors with the masks it needs."""

import copy

import torch
import torch.nn as nn

__all__ = [
    "from_nn_names",
    "load_from_nn",
    "nn_causal_mask",
    "make_nn_transformer",
    "nn_transformer",
]


def from_nn_names(tensors):
    """Rename (and split) a ``torch.nn`` state or gradient dict for our layers:
    ``in_proj_*`` is our ``qkv_proj`` in self-attention, ``q_proj`` and
    ``kv_proj`` in cross-attention."""
    out = {}
    for name, t in tensors.items():
        prefix, _, kind = name.rpartition("in_proj_")  # kind: "weight" or "bias"
        if not prefix:
            out[name] = t
        elif prefix.endswith("multihead_attn."):  # cross-attention: q | k, v
            q, kv = t.split([len(t) // 3, 2 * len(t) // 3])
            out[f"{prefix}q_proj.{kind}"], out[f"{prefix}kv_proj.{kind}"] = q, kv
        else:  # self-attention: packed
            out[f"{prefix}qkv_proj.{kind}"] = t
    return out


def load_from_nn(ragged, reference):
    """Load ``reference``'s weights (a ``torch.nn`` module) into ``ragged``."""
    ragged.load_state_dict(from_nn_names(reference.state_dict()), strict=True)
    return ragged


def nn_causal_mask(S, device=None):
    """(S, S) bool, True where a query must not see a key."""
    return torch.ones(S, S, dtype=torch.bool, device=device).triu(1)


def make_nn_transformer(d_model, nhead, num_encoder_layers, num_decoder_layers, **kw):
    """``nn.Transformer``, batch first, its encoder without nested tensors."""
    layer = nn.TransformerEncoderLayer(d_model, nhead, batch_first=True, **kw)
    norm = copy.deepcopy(layer.norm1)  # a fresh LayerNorm with the layers' eps and bias
    encoder = nn.TransformerEncoder(layer, num_encoder_layers, norm, enable_nested_tensor=False)
    return nn.Transformer(
        d_model,
        nhead,
        num_encoder_layers,
        num_decoder_layers,
        custom_encoder=encoder,
        batch_first=True,
        **kw,
    )


def nn_transformer(m, tgt, tgt_valid, src, src_valid, mask_tgt_padding=True):
    """``torch.nn`` on padded tensors and masks. With right padding no causal
    query sees a padding key: the measurements leave ``tgt_key_padding_mask``
    out, for a causal kernel."""
    return m(
        src,
        tgt,
        tgt_mask=nn_causal_mask(tgt.shape[1], tgt.device),
        tgt_is_causal=True,
        src_key_padding_mask=~src_valid,
        memory_key_padding_mask=~src_valid,
        tgt_key_padding_mask=~tgt_valid if mask_tgt_padding else None,
    )
