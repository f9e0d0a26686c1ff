"""``ragged_attention``: attention within each sequence of a packed batch, with
six backends, one module each (:mod:`.loop`, :mod:`.padded` with bucketed,
:mod:`.flex`, :mod:`.varlen`, :mod:`.njt`), and which of them can run a job
where (:func:`backend_support`)."""

import torch

from .flex import flex_backend
from .loop import loop_backend
from .njt import sdpa_njt_backend
from .padded import bucketed_backend, padded_backend
from .plan import plan_batch, without_empty_sequences
from .varlen import varlen_attn, varlen_backend, varlen_keywords

#: The names of ``ragged_attention``'s backends.
BACKENDS = ("varlen", "sdpa_njt", "flex", "loop", "bucketed", "padded")
#: Each backend's function: ``fn(q, k, v, plan, is_causal, scale, kv_used)``.
BACKEND_FUNCTIONS = {"varlen": varlen_backend, "sdpa_njt": sdpa_njt_backend, "flex": flex_backend,
                     "loop": loop_backend, "bucketed": bucketed_backend, "padded": padded_backend}


@torch.compiler.disable  # host-side bookkeeping; a compiled model calls it as is
def ragged_attention(q, k, v, q_offsets, kv_offsets=None, *, is_causal=False, kv_used=None,
                     scale=None, backend=None):
    """Attention within each sequence of a packed batch.

    q: (T_q, H, D); k, v: (T_kv, H_kv, D), with H a multiple of H_kv.
    q_offsets, kv_offsets: (B + 1,), where each sequence starts and the last
    one ends; kv_offsets defaults to q_offsets (self-attention).
    kv_used: optional (B,), how many key rows each sequence uses from its start.
    is_causal: query i of a sequence with L_q queries and L_kv keys sees keys
    0 .. i + L_kv - L_q (with L_q == L_kv, the usual causal mask).
    backend: one of BACKENDS, or None for ``default_backend``.
    Returns (T_q, H, D); a query without keys gets zeros.
    """
    check_tensors(q, k, v)
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    plan = plan_batch(q_offsets, kv_offsets, len(q), len(k), kv_used, is_causal)
    name = backend or default_backend(q.device, q.dtype)
    check_support(name, q, k, v, is_causal)
    attend = BACKEND_FUNCTIONS[name]
    if plan.has_empty or (kv_used is not None and not reads_kv_used(name)):
        return attend_nonempty(attend, q, k, v, plan, is_causal, scale)
    return attend(q, k, v, plan, is_causal, scale, kv_used)


def check_tensors(q, k, v):
    """Raise ``ValueError`` unless q is (T_q, H, D) and k, v (T_kv, H_kv, D) of
    one dtype, with H a multiple of H_kv."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"expected q (T_q, H, D) and k, v (T_kv, H_kv, D) with H a multiple "
            f"of H_kv; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype:  # fused kernels refuse a mix; autocast hides it from some
        raise ValueError(
            f"q, k and v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype} "
            "(under autocast, cast float32 rotary outputs back to the projection's dtype)"
        )


def check_support(name, q, k, v, is_causal):
    """Raise ``RuntimeError`` if backend ``name`` cannot run this call here
    (:func:`backend_support` says why)."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    why = backend_support(name, q.device, q.dtype, is_causal=is_causal, needs_grad=needs_grad,
                          gqa=q.shape[1] != k.shape[1])
    if why:
        raise RuntimeError(f"ragged_attention: backend {name!r} cannot run this here: {why}")


def reads_kv_used(name):
    """Whether backend ``name`` reads only each sequence's key rows in use
    (``kv_used``) by itself; the others get those rows gathered first."""
    return name != "sdpa_njt" and (name != "varlen" or "seqused_k" in varlen_keywords())


def attend_nonempty(attend, q, k, v, plan, is_causal, scale):
    """``attend`` on the sequences that have queries and keys in use, their
    rows gathered; zeros for the queries of the others."""
    if "nonempty" not in plan.prepared:
        plan.prepared["nonempty"] = without_empty_sequences(plan, q.device)
    q_rows, kv_rows, kept = plan.prepared["nonempty"]
    out = q.new_zeros(q.shape)
    if len(q_rows):
        out = out.index_copy(0, q_rows, attend(q[q_rows], k[kv_rows], v[kv_rows], kept, is_causal, scale))
    return out


def backend_support(name, device, dtype, *, is_causal=False, needs_grad=False, gqa=False):
    """None if backend ``name`` can run this job here, else why it cannot."""
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
    if name == "sdpa_njt" and gqa:
        return "SDPA on nested tensors cannot share key/value heads (enable_gqa)"
    if name == "sdpa_njt" and is_causal and not cuda:
        return "on CPU only the math path of SDPA takes nested tensors, and it refuses is_causal"
    if name == "sdpa_njt" and is_causal and needs_grad and dtype == torch.float32:
        return ("no CUDA kernel takes nested float32 with gradients and is_causal: flash needs 16 bits, "
                "memory-efficient refuses nested inputs that need grad, math refuses is_causal")
    if name == "flex" and needs_grad and not cuda:
        return "FlexAttention has no backward on CPU"
    return None


def default_backend(device, dtype):
    """The backend ``ragged_attention`` uses when none is named: ``varlen``
    where it runs, else ``sdpa_njt`` on CUDA, else the per-sequence loop."""
    for name in ("varlen", "sdpa_njt") if torch.device(device).type == "cuda" else ():
        if backend_support(name, device, dtype, is_causal=True, needs_grad=True) is None:
            return name
    return "loop"
