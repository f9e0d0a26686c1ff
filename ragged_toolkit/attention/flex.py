"""The ``flex`` backend: FlexAttention over the whole packed batch as one long
sequence, with a document mask built from the offsets, run by a compiled
kernel that its caller builds and owns (:class:`FlexKernel`), never
unfused."""

import types

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ..batches import offsets_from_lengths, token_index
from .dense import shares_heads

__all__ = ["FLEX_BLOCK", "FlexKernel", "document_block_mask"]

#: Rows per FlexAttention block: the padded sizes are multiples of it.
FLEX_BLOCK = 128


def _flex_call(q, k, v, block_mask, scale, enable_gqa):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _own_function(fn):
    """A copy of ``fn`` with a code object of its own: dynamo keeps its
    graphs, and counts its recompile limit, per code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def _in_graph_flex_attention(q, k, v, *, block_mask, scale=None, enable_gqa=False):
    """``flex_attention`` inside a region being compiled (the model's graph
    compiles it), its inputs as whole tensors: inductor's CPU lowering
    needs them."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def flex_runner(kernel, how_to_pass):
    """What runs FlexAttention for a plan or a paged step holding ``kernel``:
    the kernel; inside a region being compiled, without one, the region's
    own ``flex_attention``; else ``ValueError``, naming what to build and
    ``how_to_pass`` it."""
    if kernel is not None:
        return kernel
    if torch.compiler.is_compiling():
        return _in_graph_flex_attention
    raise ValueError(
        "FlexAttention outside torch.compile runs a compiled kernel that its caller owns: "
        f"build one (flex = FlexKernel()) where you build the model, and pass it: {how_to_pass}"
    )


class FlexKernel:
    """``flex_attention`` compiled for one caller. Build it once, where you
    build the model or the server (``flex = FlexKernel()``), and pass it to
    every plan (``plan_batch(..., backend="flex", flex=flex)``) and paged
    step (``build_step(..., flex=flex)``). It holds its compiled graphs;
    no module of the library does.

    It compiles a graph per configuration: device, dtype, head counts and
    sizes, grad mode, scale and, with static shapes, the padded lengths
    (``flex_rows`` keeps those to a few). ``dynamic``: None (the default)
    compiles static shapes on CPU (there dynamic shapes fail to compile the
    document mask on 2.13: a C++ compile error) and dynamic shapes on CUDA,
    one graph per configuration whatever the lengths. Each configuration
    is compiled from a function of its own: dynamo counts its recompile
    limit (8 by default) per function, and past it would run the unfused
    ``flex_attention``, which materializes every score. Past
    ``max_graphs`` configurations a call raises, naming the cause, instead
    of compiling without end. ``compile_backend``: ``torch.compile``'s
    backend (``"aot_eager"`` traces without generating kernels: for
    debugging). Inside a model being compiled,
    ``flex_attention`` is compiled with the model and the kernel is not
    used."""

    def __init__(self, *, dynamic=None, max_graphs=64, compile_backend="inductor"):
        self.dynamic, self.max_graphs, self.compile_backend = dynamic, max_graphs, compile_backend
        self.graphs = {}  # configuration -> its compiled flex_attention

    def __call__(self, q, k, v, *, block_mask, scale=None, enable_gqa=False):
        """``flex_attention(q, k, v, block_mask=..., scale=...,
        enable_gqa=...)``, compiled: q (N, H, L_q, D), k and v (N, H_kv,
        L_kv, D) -> (N, H, L_q, D)."""
        if torch.compiler.is_compiling():  # inside a compiled model: its graph compiles it
            return _in_graph_flex_attention(
                q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa
            )
        dynamic = q.device.type == "cuda" if self.dynamic is None else self.dynamic
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        lengths = None if dynamic else (q.shape[-2], k.shape[-2])
        key = (
            q.device.type,
            q.dtype,
            q.shape[1],
            k.shape[1],
            q.shape[-1],
            v.shape[-1],
            needs_grad,
            scale,
            enable_gqa,
            lengths,
        )
        if key not in self.graphs:
            if len(self.graphs) >= self.max_graphs:
                raise RuntimeError(
                    f"FlexKernel: {self.max_graphs} graphs already compiled; {q.shape[1]} heads, "
                    f"{k.shape[1]} key/value heads, head size {q.shape[-1]}, {q.dtype}, "
                    f"{q.shape[-2]} query rows would compile one more. Pad the token counts to "
                    "a few sizes (flex_rows) instead of one per count, or build the kernel "
                    "with a larger max_graphs."
                )
            compiled = torch.compile(
                _own_function(_flex_call), dynamic=dynamic, backend=self.compile_backend
            )
            self.graphs[key] = compiled
        return self.graphs[key](q, k, v, block_mask, scale, enable_gqa)


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
    attend = flex_runner(plan.flex, "plan_batch(..., backend='flex', flex=flex)")
    if not torch.is_grad_enabled():  # on CPU it refuses inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()
    (t_q, t_kv), (n_q, n_kv) = (len(q), len(k)), mask.seq_lengths
    # (T, H, D) -> (1, H, T_padded, D): the whole batch as one long sequence
    qf = F.pad(q, (0, 0, 0, 0, 0, n_q - t_q)).transpose(0, 1)[None]
    kf, vf = (F.pad(t, (0, 0, 0, 0, 0, n_kv - t_kv)).transpose(0, 1)[None] for t in (k, v))
    out = attend(qf, kf, vf, block_mask=mask, scale=scale, enable_gqa=shares_heads(qf, kf))
    return out[0, :, :t_q].transpose(0, 1)
