"""The references the pages and tests check against: attention in float32,
sequence by sequence, on SDPA's math backend; a greedy generation's logits
recomputed without a cache (teacher forcing); the recurrence on each
document alone, in float64."""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ragged_toolkit.attention.dense import bottom_right_causal
from ragged_toolkit.attention.plan import plan_batch
from ragged_toolkit.batches import offsets_from_lengths, token_index
from ragged_toolkit.layouts import PackedLayout
from ragged_toolkit.recurrent import recurrent_step, reference_recurrence
from ragged_toolkit.recurrent_hf import packed_kwargs

__all__ = [
    "reference_attention",
    "math_scores_bytes",
    "math_check_sequences",
    "teacher_forced_logits",
    "documents_reference",
    "token_loop",
    "document_differences",
]


def reference_attention(
    q, k, v, q_offsets, kv_offsets=None, *, is_causal=False, kv_used=None, scale=None
):
    """The attention of :func:`~ragged_toolkit.attention.ragged_attention` in
    float32, sequence by sequence, on the math backend of SDPA, with key/value
    heads repeated and the causal mask built explicitly: a reference that
    shares no kernel with the backends. Returns (T_q, H, D) in float32."""
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    plan = plan_batch(q_offsets, kv_offsets, backend="loop", is_causal=is_causal, kv_used=kv_used)
    if (plan.n_q, plan.n_kv) != (q.shape[0], k.shape[0]):
        raise ValueError(
            f"the offsets describe {plan.n_q} query and {plan.n_kv} key rows; "
            f"got {q.shape[0]} and {k.shape[0]}"
        )
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    q_start, kv_start = q_offsets.tolist(), kv_offsets.tolist()
    with sdpa_kernel(SDPBackend.MATH):
        for i, (lq, lkv) in enumerate(zip(plan.q_lengths, plan.kv_lengths)):
            if lq and lkv:
                qi = q[q_start[i] : q_start[i] + lq].float().transpose(0, 1)  # (H, Lq, D)
                ki, vi = (
                    t[kv_start[i] : kv_start[i] + lkv]
                    .float()
                    .repeat_interleave(group, 1)
                    .transpose(0, 1)
                    for t in (k, v)
                )  # (H, Lkv, D)
                mask = bottom_right_causal(lq, lkv, q.device) if is_causal else None
                out[q_start[i] : q_start[i] + lq] = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=scale
                ).transpose(0, 1)
    return out


def math_scores_bytes(lengths, heads, layers=1):
    """Bytes of the float32 scores and probabilities SDPA's math path keeps
    for a backward pass, over ``layers`` layers, when ``lengths`` (B,) are
    padded to the longest: ``2 x layers x B x heads x S^2 x 4``."""
    lengths = torch.as_tensor(lengths)
    return 2 * layers * len(lengths) * heads * int(lengths.max()) ** 2 * 4 if len(lengths) else 0


def math_check_sequences(lengths, heads, layers=1, budget=2**30):
    """How many of the first sequences of ``lengths`` a parity check on the
    math path can take within ``budget`` bytes (:func:`math_scores_bytes`);
    at least one. A check against the math path at GPU sizes takes a slice."""
    n = len(lengths)
    while n > 1 and math_scores_bytes(lengths[:n], heads, layers) > budget:
        n -= 1
    return n


@torch.no_grad()
def teacher_forced_logits(model, prompts, offsets, new_tokens, backend="loop"):
    """The reference for a greedy generation: each prompt followed by the
    tokens generated for it (``new_tokens``, (B, n_new)), run through the
    model once, packed, with no cache. Returns the logits that chose each new
    token, (B, n_new, vocab), in float32: a generation's own logits must
    match them within the dtype's tolerance, however rounding breaks a near
    tie (the next tokens are fed, not re-chosen)."""
    lengths, n_new = offsets.diff(), new_tokens.shape[1]
    pieces = [
        torch.cat([prompts[int(a) : int(b)], t[:-1]])
        for a, b, t in zip(offsets[:-1], offsets[1:], new_tokens)
    ]
    full = offsets_from_lengths(lengths + n_new - 1, prompts.device)
    logits = model(
        torch.cat(pieces), token_index(full)[1], PackedLayout.of(full, backend)
    )  # (T, vocab)
    rows = (
        full[:-1, None] + lengths[:, None] - 1 + torch.arange(n_new, device=prompts.device)
    )  # (B, n_new)
    return logits[rows].float()


def documents_reference(q, k, v, g, offsets, beta=None):
    """The definition for a packed batch: ``reference_recurrence`` on
    each document alone, in float64. q, k: (T, H, K); v: (T, H, V); g, beta:
    (T, H); offsets: (B + 1,). Returns o (T, H, V) and the final states
    (B, H, K, V), float64."""
    runs = [
        reference_recurrence(q[a:b], k[a:b], v[a:b], g[a:b], None if beta is None else beta[a:b])
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())
    ]
    return torch.cat([o for o, _ in runs]), torch.stack([state for _, state in runs])


def token_loop(q, k, v, g, offsets, beta=None):
    """The recurrence on a packed row, one token at a time, the state zeroed
    at each document start: the plain way to pack it, in the inputs' dtype.
    q, k: (T, H, K); v: (T, H, V); g, beta: (T, H); offsets: (B + 1,).
    Returns o (T, H, V)."""
    starts = (token_index(offsets, len(q))[1] == 0).tolist()
    state, out = q.new_zeros(q.shape[1], k.shape[2], v.shape[2]), []
    for t in range(len(q)):
        state = state * (not starts[t])  # the reset
        o, state = recurrent_step(state, q[t], k[t], v[t], g[t], None if beta is None else beta[t])
        out.append(o)
    return torch.stack(out)


@torch.no_grad()
def document_differences(model, docs, *, boundaries=False):
    """The largest absolute logit difference of each document of a packed row from the same
    document run alone. docs: token ids (L_i,) each. The row gets
    ``position_ids`` that restart at every document, and with ``boundaries``
    also ``packed_kwargs``. ``use_cache=False``: with a cache,
    ``transformers`` does not read documents from ``position_ids``, and its
    full-attention layers mix them too. Returns a list of B floats."""
    offsets = offsets_from_lengths([len(d) for d in docs])
    ids, pos = torch.cat(docs)[None], token_index(offsets)[1][None]  # (1, T) each
    extra = packed_kwargs(offsets) if boundaries else {}
    row = model(input_ids=ids, position_ids=pos, use_cache=False, **extra).logits[0]  # (T, vocab)
    return [
        float((row[a:b] - model(input_ids=d[None], use_cache=False).logits[0]).abs().max())
        for d, a, b in zip(docs, offsets[:-1].tolist(), offsets[1:].tolist())
    ]
