"""The ``sdpa_njt`` backend: SDPA on nested jagged tensors."""

import torch
import torch.nn.functional as F

from ..batches import offsets_from_lengths


def as_nested(x, lengths):
    """Packed (T, H, D) as a nested jagged tensor (B, H, j, D), ``j`` the ragged
    dimension: the same values and offsets, no copy."""
    offsets = offsets_from_lengths(lengths, x.device)
    nt = torch.nested.nested_tensor_from_jagged(x.contiguous(), offsets, max_seqlen=max(lengths))
    return nt.transpose(1, 2)


def sdpa_njt_backend(q, k, v, plan, is_causal, scale, kv_used=None):
    """``scaled_dot_product_attention`` on nested tensors built from the same
    values and offsets: q (T_q, H, D), k and v (T_kv, H, D) -> (T_q, H, D)."""
    if is_causal and plan.q_lengths != plan.kv_lengths and max(plan.q_lengths) > 1:
        raise NotImplementedError(
            "SDPA on nested tensors aligns is_causal top-left: it needs equal query and key lengths"
        )
    causal = is_causal and max(plan.q_lengths) > 1  # one query per sequence sees every key
    out = F.scaled_dot_product_attention(
        as_nested(q, plan.q_lengths),
        as_nested(k, plan.kv_rows),
        as_nested(v, plan.kv_rows),
        is_causal=causal,
        scale=scale,
    )
    return out.transpose(1, 2).values()
