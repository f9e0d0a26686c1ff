"""``ragged_attention`` as a ``transformers`` attention implementation.

``DataCollatorWithFlattening`` packs a batch into one row whose
``position_ids`` restart at 0 at every document; with
``return_flash_attn_kwargs=True`` it adds the boundaries, ``cu_seq_lens_q``.
Register :func:`ragged_attention_forward` under a name with
``AttentionInterface``, and :func:`no_mask` under the same name with
``AttentionMaskInterface``; a model built with ``attn_implementation`` set
to that name then keeps the documents of a row apart on any device.
:func:`check_attention_interface` stops a release that calls attention
functions another way. ``transformers`` is not imported here: the functions
need only what it passes them.
"""

from __future__ import annotations

import inspect

import torch

from .attention import backend_support, default_backend, plan_batch, ragged_attention
from .batches import offsets_from_position_ids

__all__ = ["check_attention_interface", "training_backend", "ragged_attention_forward", "no_mask"]

#: The first parameters of an attention function, as ``transformers`` calls it.
ATTENTION_PARAMETERS = ("module", "query", "key", "value", "attention_mask")


def _interface_changed(what):
    """The error for a ``transformers`` release that calls attention
    functions another way: it names the release and ``what`` changed."""
    try:
        import transformers

        release = f"transformers {transformers.__version__}"
    except ImportError:
        release = "transformers (not installed)"
    return RuntimeError(
        f"{release} has changed its attention interface: {what}. ragged_attention_forward "
        "needs attention functions called as (module, query (B, H, T, D), key, value, "
        "attention_mask, **kwargs), as the release it was written for calls them"
    )


def check_attention_interface(sdpa_forward):
    """Raise ``RuntimeError`` unless ``sdpa_forward``, the stock function of
    ``transformers`` (``ALL_ATTENTION_FUNCTIONS["sdpa"]``), takes
    ``ATTENTION_PARAMETERS`` first: the call that
    :func:`ragged_attention_forward` is written for."""
    called_with = list(inspect.signature(sdpa_forward).parameters)[: len(ATTENTION_PARAMETERS)]
    if called_with != list(ATTENTION_PARAMETERS):
        expected = list(ATTENTION_PARAMETERS)
        raise _interface_changed(f"its sdpa function takes {called_with}, not {expected}")


def training_backend(device, dtype, head_dim=None, *, gqa=False):
    """The backend for causal attention with gradients here: the toolkit's
    default (:func:`~ragged_toolkit.attention.default_backend`) where it takes
    grouped-query attention (``gqa``: fewer key/value heads than query
    heads), else ``bucketed``, else the per-sequence ``loop``."""
    for name in (default_backend(device, dtype, head_dim), "bucketed"):
        why = backend_support(
            name, device, dtype, is_causal=True, needs_grad=True, gqa=gqa, head_dim=head_dim
        )
        if why is None:
            return name
    return "loop"


def sequence_offsets(kwargs, batch, tokens, device):
    """(B + 1,) offsets over the B * T tokens of the rows: from ``cu_seq_lens_q``
    where the batch brought it, else where ``position_ids`` restart at 0."""
    if kwargs.get("cu_seq_lens_q") is not None:
        offsets = kwargs["cu_seq_lens_q"].to(device, torch.long)
    elif kwargs.get("position_ids") is not None:
        position_ids = kwargs["position_ids"]  # (B, T) or (1, T)
        if position_ids.shape[-1] != tokens:
            shape = tuple(position_ids.shape)
            raise _interface_changed(f"position_ids {shape} for {tokens} queries: not (B, H, T, D)")
        offsets = offsets_from_position_ids(position_ids.expand(batch, -1))
    else:
        raise _interface_changed(
            "the attention function got neither cu_seq_lens_q nor position_ids"
        )
    if int(offsets[-1]) != batch * tokens:
        last = int(offsets[-1])
        raise _interface_changed(f"boundaries up to {last} for {batch} x {tokens} tokens")
    return offsets


def ragged_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    ragged_plan=None,
    backend=None,
    **kwargs,
):
    """transformers' attention call on the toolkit: query (B, H, T, D), key and
    value (B, H_kv, T, D) -> (B, T, H, D), attention within each document.
    ``ragged_plan``: the batch's plan, built once by the caller and passed to
    the model; without it, each call plans from the boundaries in ``kwargs``
    with ``backend`` (default: :func:`training_backend` of the tensors)."""
    if attention_mask is not None:
        raise ValueError(
            "ragged_attention_forward takes packed rows (DataCollatorWithFlattening), "
            "not a padding mask"
        )
    if dropout:
        raise ValueError(
            "ragged_attention_forward has no attention dropout; set attention_dropout=0"
        )
    if query.dim() != 4 or key.shape[:1] + key.shape[2:] != query.shape[:1] + query.shape[2:]:
        raise _interface_changed(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} are "
            "not (B, H, T, D) and (B, H_kv, T, D)"
        )
    B, H, T, D = query.shape
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    plan = ragged_plan
    if plan is None:
        if backend is None:
            backend = training_backend(query.device, value.dtype, D, gqa=H != key.shape[1])
        offsets = sequence_offsets(kwargs, B, T, query.device)
        plan = plan_batch(offsets, backend=backend, is_causal=causal)
    if plan.is_causal != causal:
        raise ValueError(
            f"ragged_plan has is_causal={plan.is_causal}; this layer is_causal={causal}"
        )
    q, k, v = (t.transpose(1, 2).reshape(B * T, -1, D) for t in (query, key, value))
    # under autocast the rotary embedding returns q and k in float32: all in the dtype of v
    q, k = q.to(v.dtype), k.to(v.dtype)
    return ragged_attention(q, k, v, plan, scale=scaling).view(B, T, H, D), None


def no_mask(*args, attention_mask=None, **kwargs):
    """The mask function to register beside :func:`ragged_attention_forward`,
    under the same name, with ``AttentionMaskInterface``: no mask, the
    boundaries are enough. A padding mask is passed on, for the forward to
    refuse."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask
