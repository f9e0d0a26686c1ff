"""The ``flex`` backend: FlexAttention over the whole packed batch as one long
sequence, with a document mask built from the offsets, compiled a bounded
number of times and never run unfused."""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ..batches import offsets_from_lengths, token_index
from .dense import shares_heads

__all__ = ["FLEX_BLOCK", "compiled_flex_attention", "document_block_mask"]

#: Rows per FlexAttention block: the padded sizes are multiples of it.
FLEX_BLOCK = 128
#: The most graphs dynamo may compile for :func:`compiled_flex_attention`
#: (every head configuration, dtype, grad mode and padded size together):
#: on CPU, where shapes are static, the sizes of ``flex_rows`` up to
#: 8,192 tokens for a few configurations; on CUDA, where they are dynamic,
#: far fewer.
FLEX_RECOMPILE_LIMIT = 64

# Static shapes on CPU (there dynamic shapes fail to compile the document
# mask on 2.13: a C++ compile error), dynamic shapes on CUDA: one graph per
# head configuration, whatever the batch's size.
_compiled = torch.compile(flex_attention, dynamic=True if torch.cuda.is_available() else False)


def compiled_flex_attention(q, k, v, **kwargs):
    """``flex_attention(q, k, v, **kwargs)`` compiled, q (N, H, L_q, D), k and v
    (N, H_kv, L_kv, D). Past ``FLEX_RECOMPILE_LIMIT`` graphs it raises,
    naming the cause: it never falls back to the unfused ``flex_attention``,
    which materializes the whole score matrix (dynamo's own recompile limit,
    which would do that silently, is raised to it and made to fail). Inside
    a model being compiled, ``flex_attention`` is compiled with the model."""
    if (
        torch.compiler.is_compiling()
    ):  # (views as whole tensors: inductor's CPU lowering needs them)
        return flex_attention(q.contiguous(), k.contiguous(), v.contiguous(), **kwargs)
    limits = dict(
        recompile_limit=FLEX_RECOMPILE_LIMIT,
        fail_on_recompile_limit_hit=True,
        accumulated_recompile_limit=max(FLEX_RECOMPILE_LIMIT, 256),
    )
    try:
        with torch._dynamo.config.patch(**limits):
            return _compiled(q, k, v, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise RuntimeError(
            f"compiled_flex_attention: {FLEX_RECOMPILE_LIMIT} graphs already compiled; {q.shape[1]} heads, "
            f"{k.shape[1]} key/value heads, head size {q.shape[-1]}, {q.dtype}, {q.shape[-2]} query rows "
            "would compile one more. Pad the token counts to a few sizes (flex_rows) instead of "
            "compiling for every count."
        ) from err


def flex_rows(n):
    """The number of rows ``flex`` pads ``n`` packed tokens to: a multiple of
    :data:`FLEX_BLOCK`, rounded to four sizes per doubling above 8 blocks (at
    most a quarter more rows, plus one block), so that ``n`` from 1 to 8,192
    gives 20 sizes."""
    blocks = max(1, -(-n // FLEX_BLOCK))
    step = 1 << max(0, blocks.bit_length() - 3)  # 1 up to 7 blocks, 2 up to 15, ...
    return -(-blocks // step) * step * FLEX_BLOCK


def document_block_mask(plan):
    """The ``BlockMask`` of a packed batch padded to ``flex_rows`` rows: a
    query sees the keys of its own sequence that are in use (and, causal,
    up to its position, aligned bottom-right). Padding query rows form
    document -2, which sees one padding key; the other padding keys are
    document -1, seen by no query. The mask reads only tables of the padded
    length, so a new batch of the same padded size compiles nothing."""
    device, is_causal = plan.q_offsets.device, plan.is_causal
    t_q, t_kv = plan.n_q, plan.n_kv
    n_q = flex_rows(t_q)
    n_kv = flex_rows(t_kv + (n_q > t_q))  # a padding query needs a padding key

    def pad(x, n, fill):  # (t,) -> (n,)
        return torch.cat([x, x.new_full((n - len(x),), fill)])

    q_seq, q_pos = token_index(offsets_from_lengths(plan.q_lengths, device))
    kv_seq, kv_pos = token_index(offsets_from_lengths(plan.kv_rows, device))
    kv_used = torch.tensor(plan.kv_lengths, device=device)
    shift = kv_used - torch.tensor(plan.q_lengths, device=device)  # L_kv - L_q per sequence
    q_doc, q_pos, q_shift = pad(q_seq, n_q, -2), pad(q_pos, n_q, 0), pad(shift[q_seq], n_q, 0)
    kv_doc, kv_pos, kv_use = (
        pad(kv_seq, n_kv, -1),
        pad(kv_pos, n_kv, 0),
        pad(kv_used[kv_seq], n_kv, 1),
    )
    if n_kv > t_kv:
        kv_doc[t_kv] = -2

    def document_mask(b, h, q_idx, kv_idx):
        same = (q_doc[q_idx] == kv_doc[kv_idx]) & (kv_pos[kv_idx] < kv_use[kv_idx])
        if is_causal:
            same = same & (kv_pos[kv_idx] <= q_pos[q_idx] + q_shift[q_idx])
        return same

    return create_block_mask(
        document_mask, None, None, n_q, n_kv, device=device, BLOCK_SIZE=FLEX_BLOCK
    )


def prepare_flex(plan):
    """What ``flex`` builds once per batch: :func:`document_block_mask`."""
    return document_block_mask(plan)


def flex_backend(q, k, v, plan, scale=None):
    """FlexAttention over the whole batch as one long sequence, padded to a few
    sizes, with its document mask: q (T_q, H, D), k and v (T_kv, H_kv, D)
    -> (T_q, H, D)."""
    mask = plan.prepared
    if not torch.is_grad_enabled():  # on CPU it refuses inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()
    (t_q, t_kv), (n_q, n_kv) = (len(q), len(k)), mask.seq_lengths
    # (T, H, D) -> (1, H, T_padded, D): the whole batch as one long sequence
    qf = F.pad(q, (0, 0, 0, 0, 0, n_q - t_q)).transpose(0, 1)[None]
    kf, vf = (F.pad(t, (0, 0, 0, 0, 0, n_kv - t_kv)).transpose(0, 1)[None] for t in (k, v))
    out = compiled_flex_attention(
        qf, kf, vf, block_mask=mask, scale=scale, enable_gqa=shares_heads(qf, kf)
    )
    return out[0, :, :t_q].transpose(0, 1)
