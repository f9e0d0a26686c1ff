"""The ``varlen`` backend: ``varlen_attn``, the variable-length kernel of
FlashAttention (CUDA, 16-bit)."""

import inspect

import torch

from ..batches import offsets_from_lengths

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # not in this build of PyTorch
    varlen_attn = None


def varlen_keywords():
    """The keyword arguments the installed ``varlen_attn`` takes (they changed
    between releases: ``is_causal``, then ``window_size``, ``enable_gqa``,
    ``seqused_k``); empty where this PyTorch has no ``varlen_attn``."""
    return set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()


def varlen_backend(q, k, v, plan, is_causal, scale, kv_used=None):
    """``varlen_attn`` on the packed batch: q (T_q, H, D), k and v (T_kv, H_kv,
    D) -> (T_q, H, D), the offsets as ``int32`` ``cu_seq_q`` and ``cu_seq_k``."""
    keywords, kw = varlen_keywords(), {"scale": scale}
    if is_causal:  # a flag in PyTorch 2.10, a window from 2.11 on
        kw.update({"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True})
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in keywords:
            kw["enable_gqa"] = True
        else:  # older releases: repeat each key/value head for its query heads
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if kv_used is not None:  # only where the release reads it (``reads_kv_used``)
        kw["seqused_k"] = kv_used.to(torch.int32)
    cu_seq_q = offsets_from_lengths(plan.q_lengths, q.device).to(torch.int32)
    cu_seq_k = offsets_from_lengths(plan.kv_rows, q.device).to(torch.int32)
    max_q, max_k = max(plan.q_lengths), max(plan.kv_rows)
    return varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, **kw)
