"""A multi-head attention layer that runs on a packed batch or, unchanged, on
a padded one, and the ``nn.Transformer`` family built on it: the same names,
defaults and weights as ``torch.nn``, a batch's plan instead of its padding
masks."""

import copy

import torch.nn as nn
import torch.nn.functional as F

from .attention import plan_batch, ragged_attention

__all__ = [
    "MultiHeadAttention",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "Transformer",
    "plan_transformer",
]


class MultiHeadAttention(nn.Module):
    """Multi-head attention on a packed batch or, unchanged, a padded one.

    ``forward(x, plan)``: x (T, E) packed, through ``ragged_attention`` with
    the batch's plan (``plan_batch(offsets, backend=..., is_causal=...)``;
    for cross-attention, ``plan_batch(offsets, context_offsets, ...)``).
    ``forward(x)``: x (B, S, E) padded, one SDPA call; ``key_valid``
    (B, S_kv) masks padding keys. With ``cross=True`` the keys and values
    come from ``context``. Returns the shape of x.
    """

    def __init__(self, embed, heads, *, cross=False, bias=True, device=None, dtype=None):
        super().__init__()
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.heads, self.cross = heads, cross
        if cross:
            self.q_proj = nn.Linear(embed, embed, **kw)
            self.kv_proj = nn.Linear(embed, 2 * embed, **kw)
        else:
            self.qkv_proj = nn.Linear(embed, 3 * embed, **kw)
        self.out_proj = nn.Linear(embed, embed, **kw)

    def forward(self, x, plan=None, *, context=None, key_valid=None, is_causal=False):
        # packed: x (T, E) with the batch's plan; padded: x (B, S, E), and
        # key_valid (B, S_kv) where some keys are padding that must be masked
        if self.cross:
            q, (k, v) = self.q_proj(x), self.kv_proj(context).chunk(2, dim=-1)
        else:
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)) for t in (q, k, v))  # (..., H, D)
        if plan is not None:
            out = ragged_attention(q, k, v, plan)  # (T, H, D); causal or not as planned
        else:
            mask = None if key_valid is None else key_valid[:, None, None, :]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask,
                is_causal=is_causal,
            ).transpose(1, 2)
        return self.out_proj(out.flatten(-2))


class TransformerEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` on a packed batch: x (T, E) and its plan."""

    def __init__(
        self,
        d_model,
        nhead,
        dim_feedforward=2048,
        dropout=0.1,
        activation="relu",
        layer_norm_eps=1e-5,
        norm_first=False,
        bias=True,
    ):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, nhead, bias=bias)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)  # inside the feed-forward block
        self.dropout1 = nn.Dropout(dropout)  # after attention
        self.dropout2 = nn.Dropout(dropout)  # after the feed-forward block
        self.activation = {"relu": F.relu, "gelu": F.gelu}[activation]
        self.norm_first = norm_first

    def _residual(self, x, norm, sublayer):
        """Pre-norm or post-norm, as ``torch.nn``."""
        return x + sublayer(norm(x)) if self.norm_first else norm(x + sublayer(x))

    def _ff(self, x, dropout):
        return dropout(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x, plan):
        # x (T, E) -> (T, E); the plan says whether attention is causal
        x = self._residual(x, self.norm1, lambda h: self.dropout1(self.self_attn(h, plan)))
        return self._residual(x, self.norm2, lambda h: self._ff(h, self.dropout2))


class TransformerDecoderLayer(TransformerEncoderLayer):
    """``nn.TransformerDecoderLayer``: self-attention, then cross-attention to
    ``memory`` (T_src, E) with a plan of its own."""

    def __init__(self, d_model, nhead, *args, **kwargs):
        # the encoder layer's arguments
        super().__init__(d_model, nhead, *args, **kwargs)
        bias = self.norm1.bias is not None
        self.multihead_attn = MultiHeadAttention(d_model, nhead, cross=True, bias=bias)
        self.norm3 = nn.LayerNorm(d_model, eps=self.norm1.eps, bias=bias)
        self.dropout3 = nn.Dropout(self.dropout1.p)  # dropout2: after cross-attention

    def forward(self, x, plan, memory, memory_plan):
        def cross(h):
            return self.dropout2(self.multihead_attn(h, memory_plan, context=memory))

        x = self._residual(x, self.norm1, lambda h: self.dropout1(self.self_attn(h, plan)))
        x = self._residual(x, self.norm2, cross)
        return self._residual(x, self.norm3, lambda h: self._ff(h, self.dropout3))


class TransformerEncoder(nn.Module):
    """``num_layers`` copies of a layer, then an optional final norm."""

    def __init__(self, encoder_layer, num_layers, norm=None):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(encoder_layer) for _ in range(num_layers))
        self.norm = norm

    def forward(self, x, *args):  # args: what each layer takes after x
        for layer in self.layers:
            x = layer(x, *args)
        return x if self.norm is None else self.norm(x)


TransformerDecoder = TransformerEncoder  # the same loop, over decoder layers


class Transformer(nn.Module):
    """``nn.Transformer`` on packed batches: an encoder and a decoder stack,
    each with a final norm, every matrix initialized as ``torch.nn`` does
    (Xavier-uniform). ``forward(src, tgt, plans)`` takes the batch's three
    plans by job (:func:`plan_transformer`)."""

    def __init__(
        self,
        d_model=512,
        nhead=8,
        num_encoder_layers=6,
        num_decoder_layers=6,
        dim_feedforward=2048,
        dropout=0.1,
        activation="relu",
        layer_norm_eps=1e-5,
        norm_first=False,
        bias=True,
    ):
        super().__init__()
        args = (d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps)
        args += (norm_first, bias)
        norm = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        encoder_layer = TransformerEncoderLayer(*args)
        self.encoder = TransformerEncoder(encoder_layer, num_encoder_layers, copy.deepcopy(norm))
        self.decoder = TransformerDecoder(TransformerDecoderLayer(*args), num_decoder_layers, norm)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, tgt, plans):
        # src (T_src, E), tgt (T_tgt, E) -> (T_tgt, E)
        memory = self.encoder(src, plans["encoder"])
        return self.decoder(tgt, plans["decoder"], memory, plans["cross"])


def plan_transformer(
    src_offsets, tgt_offsets, encoder="loop", decoder="loop", cross="loop", flex=None
):
    """A batch's plans by job, each on its backend: the encoder's, the
    decoder's (causal), and cross-attention's, from the targets to the
    sources. ``flex``: the :class:`~ragged_toolkit.attention.flex.FlexKernel`
    of a flex plan."""
    return {
        "encoder": plan_batch(src_offsets, backend=encoder, flex=flex),
        "decoder": plan_batch(tgt_offsets, backend=decoder, is_causal=True, flex=flex),
        "cross": plan_batch(tgt_offsets, src_offsets, backend=cross, flex=flex),
    }
