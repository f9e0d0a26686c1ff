"""Packed training on several ranks, what each rank does: micro-batches dealt
to the ranks and the imbalance of their tokens, the step compiled whole, a
loss normalized over every rank, the DDP and FSDP2 wrapping."""

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .batches import token_index
from .data import document_targets
from .layouts import PackedLayout

__all__ = ["deal_to_ranks", "token_loss_sum", "data_parallel_step", "wrap_model"]

# --- micro-batches dealt to the ranks ------------------------------------------------


def deal_to_ranks(micro_batches, world, per_rank):
    """The steps of ``world`` ranks that run ``per_rank`` micro-batches each,
    the micro-batches (a list of ``(tokens, offsets)``) dealt in turn, as
    ``DistributedSampler`` deals samples: ``steps[s][r]`` is the list of rank
    ``r``'s micro-batches in step ``s``. What is left after the last whole
    step is left out."""
    if world < 1 or per_rank < 1:
        raise ValueError(f"world ({world}) and per_rank ({per_rank}) must be at least 1")
    per_step = world * per_rank
    return [
        [micro_batches[s + r : s + per_step : world] for r in range(world)]
        for s in range(0, len(micro_batches) - per_step + 1, per_step)
    ]


# --- the loss of a step, on every rank ---------------------------------------------


def token_loss_sum(model, tokens, offsets, backend=None, dtype=torch.float32, *, layout=None):
    """The sum of the next-token losses of a packed micro-batch and its
    number of targets (each document's last token has none). ``layout``: how
    the model's attention reads the micro-batch, built outside the model
    (default: the packed layout, its plan built here for ``backend``)."""
    targets = document_targets(tokens, offsets)
    layout = PackedLayout.of(offsets, backend, dtype) if layout is None else layout
    with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(tokens, token_index(offsets)[1], layout)  # (T, vocab)
    loss = F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
    return loss, (targets != -100).sum()


def data_parallel_step(
    model, micro_batches, sync=None, *, reduce_count=True, backend=None, dtype=torch.float32
):
    """Forward and backward of one step with gradient accumulation, on this rank.

    The loss of the step is the sum of the token losses of every micro-batch
    on every rank, divided by the number of targets of all of them: the
    count is summed over the ranks (``all_reduce``) before any backward.
    ``sync(last)`` gives the context for a micro-batch's backward (the
    ``no_sync`` of DDP for all but the last). DDP and FSDP2 average the
    gradients over the ranks, so each rank's loss is multiplied by the world
    size. ``reduce_count=False`` is the usual mistake: each rank divides by
    its own count. Returns the step's loss summed over this rank's micro-batches."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    count = sum(int((document_targets(t, o) != -100).sum()) for t, o in micro_batches)
    count = torch.tensor(count, device=micro_batches[0][0].device)
    if reduce_count and world > 1:
        dist.all_reduce(count)  # every rank now holds the step's count
    scale = world / count if reduce_count else 1 / count
    total = 0.0
    for i, (tokens, offsets) in enumerate(micro_batches):
        with sync(i == len(micro_batches) - 1) if sync is not None else nullcontext():
            loss_sum, _ = token_loss_sum(model, tokens, offsets, backend, dtype)
            (loss_sum * scale).backward()
        total += loss_sum.item() * float(scale) / world
    return total


# --- the wrapping, on each rank ------------------------------------------------------


def wrap_model(model, how, device):
    """``model`` (a :class:`~ragged_toolkit.gpt.GPT` on ``device``) wrapped for
    data parallelism on this rank, ``how`` ``"ddp"`` or ``"fsdp"``. Returns
    what to call, and ``sync(last)``: the context of each micro-batch's
    backward, which exchanges gradients only after the last one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if how == "ddp":
        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        return ddp, lambda last: nullcontext() if last else ddp.no_sync()
    if how == "fsdp":
        # the mesh named, not guessed: ranks on the CPU keep their shards on the CPU
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.layers:
            fully_shard(block, mesh=mesh)  # each rank holds 1 / world of every weight
        fully_shard(model, mesh=mesh)

        def sync(last):
            model.set_requires_gradient_sync(last)  # reduce-scatter after the last only
            return nullcontext()

        return model, sync
    raise ValueError(f"unknown wrapper {how!r}: ddp or fsdp")
