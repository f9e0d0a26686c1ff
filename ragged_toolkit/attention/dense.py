"""Dense attention on one padded block: the SDPA call the loop, bucketed and
padded backends make, the causal mask of a block with more keys than
queries, and the kernel order of the backends that meet many shapes."""

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = []

#: SDPA's kernel order for a backend that calls it on a new shape for
#: nearly every sequence length (``loop``, ``bucketed``): cuDNN attention,
#: first on recent GPUs, builds a plan for each new shape (tens of
#: milliseconds each), so it goes after flash and memory-efficient attention.
MANY_SHAPES_ORDER = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
]


def many_shapes_kernels(device):
    """On CUDA, SDPA's kernels in ``MANY_SHAPES_ORDER`` while the block
    runs (every kernel stays allowed; only the order changes); elsewhere,
    nothing changes."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(MANY_SHAPES_ORDER, set_priority=True)


def bottom_right_causal(lq, lkv, device):
    """(lq, lkv), True where a query may see a key; aligned bottom-right, as in
    FlashAttention and ``varlen_attn``: the last query sees every key."""
    return torch.ones(lq, lkv, dtype=torch.bool, device=device).tril(lkv - lq)


def shares_heads(q, k):
    """Whether q (N, H, L, D) has more heads than k (N, H_kv, L, D): grouped-
    query attention, SDPA's ``enable_gqa``. A Python bool also where the
    head counts are symbolic (a branch makes ``torch.compile`` decide it)."""
    return True if q.shape[1] != k.shape[1] else False


def dense_attention(q, k, v, is_causal, scale, mask=None):
    """SDPA on q (N, H, Lq, D) and k, v (N, H_kv, Lkv, D); ``mask``, if given,
    holds everything a query may see. Every query has at least one key."""
    lq, lkv, gqa = q.shape[-2], k.shape[-2], shares_heads(q, k)
    if mask is None and is_causal and lq == lkv:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if mask is None and is_causal and lq > 1:
        mask = bottom_right_causal(lq, lkv, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
