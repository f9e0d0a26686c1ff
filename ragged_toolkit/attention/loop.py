"""The ``loop`` backend: one dense SDPA call per sequence."""

import torch

from .dense import dense_attention, many_shapes_kernels

__all__ = []


def loop_backend(q, k, v, plan, scale=None):
    """One dense SDPA call per sequence, on views of the packed tensors: q
    (T_q, H, D), k and v (T_kv, H_kv, D) -> (T_q, H, D). The plan's lengths
    are Python ints, so a compiled model unrolls the loop for its batch. On
    CUDA, cuDNN attention comes after flash and memory-efficient attention
    here (``many_shapes_kernels``)."""
    # (T, H, D) -> (1, H, T, D) once; ``split`` then gives one view per
    # sequence, and its backward is a single concatenation
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = []
    with many_shapes_kernels(q.device):  # a new shape per length: cuDNN's plans last
        for qi, ki, vi, n in zip(
            qh.split(plan.q_lengths, 2),
            kh.split(plan.kv_rows, 2),
            vh.split(plan.kv_rows, 2),
            plan.kv_lengths,
        ):
            # the key rows in use (a cache has spare rows after them)
            out.append(dense_attention(qi, ki[:, :, :n], vi[:, :, :n], plan.is_causal, scale))
    return torch.cat(out, 2)[0].transpose(0, 1)  # (T_q, H, D)
