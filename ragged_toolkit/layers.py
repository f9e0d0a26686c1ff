"""A multi-head attention layer that runs on a packed batch or, unchanged, on
a padded one."""

import torch.nn as nn
import torch.nn.functional as F

from .attention import ragged_attention

__all__ = ["MultiHeadAttention"]


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
