"""The ``sdpa_njt`` backend: SDPA on nested jagged tensors."""

import torch
import torch.nn.functional as F

__all__ = []


def _as_nested(x, offsets, max_len):
    """Packed (T, H, D) as a nested jagged tensor (B, H, j, D), ``j`` the ragged
    dimension: the same values and offsets (B + 1,), no copy."""
    nt = torch.nested.nested_tensor_from_jagged(x.contiguous(), offsets, max_seqlen=max_len)
    return nt.transpose(1, 2)


def prepare_njt(plan):
    """What ``sdpa_njt`` checks once per batch: SDPA on nested tensors aligns
    ``is_causal`` top-left, so a causal batch needs as many queries as keys
    in every sequence (or one query per sequence, which sees every key)."""
    if plan.is_causal and plan.q_lengths != plan.kv_lengths and plan.max_q > 1:
        raise NotImplementedError(
            "SDPA on nested tensors aligns is_causal top-left: it needs equal query and key lengths"
        )


def sdpa_njt_backend(q, k, v, plan, scale=None):
    """``scaled_dot_product_attention`` on nested tensors built from the same
    values and offsets: q (T_q, H, D), k and v (T_kv, H, D) -> (T_q, H, D)."""
    causal = plan.is_causal and plan.max_q > 1  # one query per sequence sees every key
    out = F.scaled_dot_product_attention(
        _as_nested(q, plan.q_offsets, plan.max_q),
        _as_nested(k, plan.kv_offsets, plan.max_kv),
        _as_nested(v, plan.kv_offsets, plan.max_kv),
        is_causal=causal,
        scale=scale,
    )
    return out.transpose(1, 2).values()
