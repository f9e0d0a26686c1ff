"""The ``varlen`` backend: ``varlen_attn``, the variable-length kernel of
FlashAttention (CUDA, 16-bit), and the one place that adapts a call to the
keyword arguments of the installed release: they changed in every release
from 2.10 to 2.12 (``is_causal``, then ``window_size`` and ``scale``, then
``enable_gqa``, ``seqused_k``, ``block_table`` and ``num_splits``)."""

from __future__ import annotations

import inspect

import torch

__all__ = ["VarlenUnavailable", "varlen_kwargs", "varlen_missing"]

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # not in this build of PyTorch
    varlen_attn = None

#: The keyword arguments of this release's ``varlen_attn``, read from its
#: signature once, at import (empty where this PyTorch has none, and in a
#: documentation build without torch, where autodoc's stand-in has no signature).
VARLEN_KEYWORDS = (
    frozenset()
    if varlen_attn is None or getattr(varlen_attn, "__sphinx_mock__", False)
    else frozenset(inspect.signature(varlen_attn).parameters)
)


class VarlenUnavailable(RuntimeError):
    """This release's ``varlen_attn`` lacks a feature a call needs."""


def varlen_missing(features, keywords=None):
    """The features among ``features`` (``"causal"``, ``"scale"``,
    ``"enable_gqa"``, ``"seqused_k"``, ``"block_table"``, ``"num_splits"``)
    that a ``varlen_attn`` with keyword arguments ``keywords`` (default:
    this release's, ``VARLEN_KEYWORDS``) cannot take."""
    keywords = VARLEN_KEYWORDS if keywords is None else keywords
    has = {"causal": bool({"window_size", "is_causal"} & keywords)}
    return [f for f in features if not has.get(f, f in keywords)]


def varlen_kwargs(
    *,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
    keywords=None,
):
    """The keyword arguments that ask a ``varlen_attn`` whose keywords are
    ``keywords`` (default: this release's) for this call: causal as
    ``window_size=(-1, 0)`` (2.11 on) or ``is_causal=True`` (2.10), and each
    other feature under its own name. Raises :class:`VarlenUnavailable`
    naming what the release lacks; nothing is dropped silently."""
    whose = "this release's" if keywords is None else "a"
    keywords = VARLEN_KEYWORDS if keywords is None else keywords
    wanted = {
        "scale": scale,
        "enable_gqa": enable_gqa or None,
        "seqused_k": seqused_k,
        "block_table": block_table,
        "num_splits": num_splits,
    }
    wanted = {name: value for name, value in wanted.items() if value is not None}
    missing = varlen_missing(["causal"] * is_causal + list(wanted), keywords)
    if missing:
        raise VarlenUnavailable(
            f"{whose} varlen_attn has no {', '.join(missing)} "
            f"(its keywords: {', '.join(sorted(keywords)) or 'none'})"
        )
    if is_causal:
        wanted.update(
            {"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True}
        )
    return wanted


def prepare_varlen(plan):
    """What ``varlen`` builds once per batch: the offsets as ``int32``
    ``cu_seq_q`` and ``cu_seq_k``, and the keys in use as ``int32``
    ``seqused_k`` where the batch has them."""
    used = None if plan.kv_used is None else plan.kv_used.to(torch.int32)
    return plan.q_offsets.to(torch.int32), plan.kv_offsets.to(torch.int32), used


def varlen_backend(q, k, v, plan, scale=None):
    """``varlen_attn`` on the packed batch: q (T_q, H, D), k and v (T_kv, H_kv,
    D) -> (T_q, H, D). A release without ``enable_gqa`` (2.11) gets each
    key/value head repeated for its query heads: the same result, more memory."""
    cu_seq_q, cu_seq_k, seqused_k = plan.prepared
    gqa = bool(q.shape[1] != k.shape[1])
    if gqa and varlen_missing(["enable_gqa"]):
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        gqa = False
    kw = varlen_kwargs(is_causal=plan.is_causal, scale=scale, enable_gqa=gqa, seqused_k=seqused_k)
    return varlen_attn(q, k, v, cu_seq_q, cu_seq_k, plan.max_q, plan.max_kv, **kw)
