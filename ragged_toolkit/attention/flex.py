"""The ``flex`` backend: FlexAttention over the whole packed batch as one long
sequence, with a document mask built from the offsets, compiled a bounded
number of times and never run unfused."""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ..batches import offsets_from_lengths, token_index

#: Rows per FlexAttention block: the padded sizes are multiples of it.
FLEX_BLOCK = 128
#: The most shapes :func:`compiled_flex_attention` compiles for one head
#: configuration (heads, key/value heads, head size, dtype, device): the
#: sizes of :func:`flex_rows` up to 8,192 tokens, with room for a few more.
FLEX_SHAPES_PER_CONFIGURATION = 32

# Static shapes on CPU (there dynamic shapes fail to compile the document
# mask on 2.13: a C++ compile error), automatic dynamic shapes on CUDA.
_compiled = torch.compile(flex_attention, dynamic=None if torch.cuda.is_available() else False)
_shapes = {}  # head configuration -> the shapes compiled for it


def compiled_flex_attention(q, k, v, **kwargs):
    """``flex_attention(q, k, v, **kwargs)`` compiled, q (N, H, L_q, D), k and v
    (N, H_kv, L_kv, D). Compiled graphs are counted per head configuration:
    past :data:`FLEX_SHAPES_PER_CONFIGURATION` shapes it raises, naming the
    cause, and it never falls back to the unfused ``flex_attention``, which
    materializes the whole score matrix (dynamo's recompile limit, which would
    do that silently, is lifted during the call and fails if still hit)."""
    config = (q.shape[1], k.shape[1], q.shape[-1], q.dtype, q.device.type)
    shape = (q.shape[0], q.shape[-2], k.shape[-2], q.requires_grad and torch.is_grad_enabled())
    seen = _shapes.setdefault(config, set())
    if shape not in seen and len(seen) >= FLEX_SHAPES_PER_CONFIGURATION:
        raise RuntimeError(
            f"compiled_flex_attention: {len(seen)} shapes already compiled for {config[0]} heads, "
            f"{config[1]} key/value heads, head size {config[2]}, {config[3]}: a new one, "
            f"{shape[1:3]}, would compile one more graph. Pad the token counts to a few sizes "
            "(flex_rows) instead of compiling for every count."
        )
    seen.add(shape)
    limit = FLEX_SHAPES_PER_CONFIGURATION * max(len(_shapes), 1) + 8
    with torch._dynamo.config.patch(
        recompile_limit=limit, accumulated_recompile_limit=max(limit, 256), fail_on_recompile_limit_hit=True
    ):
        return _compiled(q, k, v, **kwargs)


def flex_rows(n):
    """The number of rows ``flex`` pads ``n`` packed tokens to: a multiple of
    :data:`FLEX_BLOCK`, rounded to four sizes per doubling above 8 blocks (at
    most a quarter more rows, plus one block), so that ``n`` from 1 to 8,192
    gives 20 sizes."""
    blocks = max(1, -(-n // FLEX_BLOCK))
    step = 1 << max(0, blocks.bit_length() - 3)  # 1 up to 7 blocks, 2 up to 15, ...
    return -(-blocks // step) * step * FLEX_BLOCK


def document_block_mask(plan, device, is_causal):
    """The ``BlockMask`` of a packed batch padded to :func:`flex_rows` rows: a
    query sees the keys of its own sequence that are in use (and, causal,
    up to its position, aligned bottom-right). Padding query rows form
    document -2, which sees one padding key; the other padding keys are
    document -1, seen by no query. The mask reads only tables of the padded
    length, so a new batch of the same padded size compiles nothing."""
    t_q, t_kv = sum(plan.q_lengths), sum(plan.kv_rows)
    n_q = flex_rows(t_q)
    n_kv = flex_rows(t_kv + (n_q > t_q))  # a padding query needs a padding key

    def pad(x, n, fill):  # (t,) -> (n,)
        return torch.cat([x, x.new_full((n - len(x),), fill)])

    q_seq, q_pos = token_index(offsets_from_lengths(plan.q_lengths, device))
    kv_seq, kv_pos = token_index(offsets_from_lengths(plan.kv_rows, device))
    kv_used = torch.tensor(plan.kv_lengths, device=device)
    shift = kv_used - torch.tensor(plan.q_lengths, device=device)  # L_kv - L_q per sequence
    q_doc, q_pos, q_shift = pad(q_seq, n_q, -2), pad(q_pos, n_q, 0), pad(shift[q_seq], n_q, 0)
    kv_doc, kv_pos, kv_use = pad(kv_seq, n_kv, -1), pad(kv_pos, n_kv, 0), pad(kv_used[kv_seq], n_kv, 1)
    if n_kv > t_kv:
        kv_doc[t_kv] = -2

    def document_mask(b, h, q_idx, kv_idx):
        same = (q_doc[q_idx] == kv_doc[kv_idx]) & (kv_pos[kv_idx] < kv_use[kv_idx])
        if is_causal:
            same = same & (kv_pos[kv_idx] <= q_pos[q_idx] + q_shift[q_idx])
        return same

    return create_block_mask(document_mask, None, None, n_q, n_kv, device=device, BLOCK_SIZE=FLEX_BLOCK)


def flex_backend(q, k, v, plan, is_causal, scale, kv_used=None):
    """FlexAttention over the whole batch as one long sequence, padded to a few
    sizes, with its document mask: q (T_q, H, D), k and v (T_kv, H_kv, D)
    -> (T_q, H, D)."""
    if ("flex", is_causal) not in plan.prepared:  # one BlockMask per batch, for every layer
        plan.prepared["flex", is_causal] = document_block_mask(plan, q.device, is_causal)
    mask = plan.prepared["flex", is_causal]
    if not torch.is_grad_enabled():  # on CPU it refuses inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()
    (t_q, t_kv), (n_q, n_kv) = (len(q), len(k)), mask.seq_lengths
    # (T, H, D) -> (1, H, T_padded, D): the whole batch as one long sequence
    qf = F.pad(q, (0, 0, 0, 0, 0, n_q - t_q)).transpose(0, 1)[None]
    kf, vf = (F.pad(t, (0, 0, 0, 0, 0, n_kv - t_kv)).transpose(0, 1)[None] for t in (k, v))
    out = compiled_flex_attention(qf, kf, vf, block_mask=mask, scale=scale,
                                  enable_gqa=q.shape[1] != k.shape[1])
    return out[0, :, :t_q].transpose(0, 1)
