"""``ragged_attention``: attention within each sequence of a packed batch,
given the batch's plan (:func:`~ragged_toolkit.attention.plan.plan_batch`),
with six backends, one module each (:mod:`.loop`, :mod:`.padded` with
bucketed, :mod:`.flex`, :mod:`.varlen`, :mod:`.njt`), and which of them can
run a job where (:func:`backend_support`)."""

from __future__ import annotations

import torch

from .flex import flex_backend
from .loop import loop_backend
from .njt import sdpa_njt_backend
from .padded import bucketed_backend, padded_backend
from .plan import BACKENDS, BatchPlan, plan_batch
from .varlen import varlen_attn, varlen_backend

__all__ = [
    "BACKENDS",
    "BatchPlan",
    "plan_batch",
    "ragged_attention",
    "backend_support",
    "default_backend",
]

# Each backend's function: ``fn(q, k, v, plan, scale)``.
_ATTEND = {
    "varlen": varlen_backend,
    "sdpa_njt": sdpa_njt_backend,
    "flex": flex_backend,
    "loop": loop_backend,
    "bucketed": bucketed_backend,
    "padded": padded_backend,
}


def ragged_attention(q, k, v, plan, *, scale=None):
    """Attention within each sequence of a packed batch.

    q: (T_q, H, D); k, v: (T_kv, H_kv, D), with H a multiple of H_kv.
    plan: the batch's :class:`~ragged_toolkit.attention.plan.BatchPlan`
    from ``plan_batch(q_offsets, kv_offsets, backend=..., is_causal=...,
    kv_used=...)``, built once per batch and shared by every layer. With
    ``is_causal``, query i of a sequence with L_q queries and L_kv keys sees
    keys 0 .. i + L_kv - L_q (with L_q == L_kv, the usual causal mask).
    Returns (T_q, H, D); a query without keys gets zeros. Reads nothing back
    from the device: compiles into one graph.
    """
    _check_tensors(q, k, v, plan)
    _check_support(plan.backend, q, k, v, plan.is_causal)
    attend = _ATTEND[plan.backend]
    if plan.nonempty is None:
        return attend(q, k, v, plan, scale)
    q_rows, kv_rows, kept = plan.nonempty  # some sequences skipped: their queries get zeros
    out = q.new_zeros(q.shape)
    if kept is None:
        return out
    return out.index_copy(0, q_rows, attend(q[q_rows], k[kv_rows], v[kv_rows], kept, scale))


def _check_tensors(q, k, v, plan):
    """Raise ``ValueError`` unless q is (T_q, H, D) and k, v (T_kv, H_kv, D) of
    one dtype, with H a multiple of H_kv, and ``plan`` describes their rows."""
    if (
        q.dim() != 3
        or k.dim() != 3
        or k.shape != v.shape
        or q.shape[2] != k.shape[2]
        or q.shape[1] % k.shape[1]
    ):
        raise ValueError(
            f"expected q (T_q, H, D) and k, v (T_kv, H_kv, D) with H a multiple "
            f"of H_kv; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype:  # fused kernels refuse a mix; autocast hides it from some
        raise ValueError(
            f"q, k and v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype} "
            "(under autocast, cast float32 rotary outputs back to the projection's dtype)"
        )
    if not isinstance(plan, BatchPlan):
        raise TypeError(
            f"ragged_attention takes the batch's plan, from plan_batch(offsets, backend=...); "
            f"got {type(plan).__name__}"
        )
    if q.shape[0] != plan.n_q or k.shape[0] != plan.n_kv:
        raise ValueError(
            f"the plan describes {plan.n_q} query rows and {plan.n_kv} key rows; "
            f"got {q.shape[0]} and {k.shape[0]}: plan this batch with plan_batch"
        )


def _check_support(name, q, k, v, is_causal):
    """Raise ``RuntimeError`` if backend ``name`` cannot run this call here
    (:func:`backend_support` says why)."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    why = backend_support(
        name,
        q.device,
        q.dtype,
        is_causal=is_causal,
        needs_grad=needs_grad,
        gqa=q.shape[1] != k.shape[1],
        head_dim=q.shape[-1],
    )
    if why:
        raise RuntimeError(f"ragged_attention: backend {name!r} cannot run this here: {why}")


def backend_support(
    name, device, dtype, *, is_causal=False, needs_grad=False, gqa=False, head_dim=None
):
    """None if backend ``name`` can run this job here, else why it cannot.
    ``head_dim``: the head size, where known (the CUDA kernels limit it)."""
    cuda = torch.device(device).type == "cuda"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    if name == "varlen":
        if varlen_attn is None:
            return "this PyTorch has no torch.nn.attention.varlen"
        if not cuda:
            return "needs CUDA (it calls the FlashAttention kernel)"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "needs a GPU of compute capability 8.0 or newer (FlashAttention)"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"needs float16 or bfloat16, not {dtype}"
        if head_dim is not None and (head_dim % 8 or head_dim > 256):
            return f"FlashAttention needs a head size that is a multiple of 8, at most 256, not {head_dim}"
    if name == "sdpa_njt" and gqa:
        return "SDPA on nested tensors cannot share key/value heads (enable_gqa)"
    if name == "sdpa_njt" and is_causal and not cuda:
        return "on CPU only the math path of SDPA takes nested tensors, and it refuses is_causal"
    if name == "sdpa_njt" and is_causal and needs_grad and dtype == torch.float32 and cuda:
        return (
            "no CUDA kernel takes nested float32 with gradients and is_causal: flash needs 16 bits, "
            "memory-efficient refuses nested inputs that need grad, math refuses is_causal"
        )
    if name == "flex" and needs_grad and not cuda:
        return "FlexAttention has no backward on CPU"
    if name == "flex" and cuda and head_dim is not None and head_dim < 16:
        return f"FlexAttention on CUDA needs a head size of at least 16, not {head_dim}"
    return None


def default_backend(device, dtype, head_dim=None):
    """The backend to use when a caller has measured nothing: ``varlen``
    where it runs, else ``sdpa_njt`` on CUDA, else the per-sequence loop."""
    for name in ("varlen", "sdpa_njt") if torch.device(device).type == "cuda" else ():
        if (
            backend_support(name, device, dtype, is_causal=True, needs_grad=True, head_dim=head_dim)
            is None
        ):
            return name
    return "loop"
