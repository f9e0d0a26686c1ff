"""Packed training on several ranks, what each rank does: the checks that a
pack trains each document as if it were alone, micro-batches dealt to the
ranks and the imbalance of their tokens, the step compiled whole, a loss
normalized over every rank, the DDP and FSDP2 wrapping.
:mod:`ragged_toolkit.data_parallel_launch` starts the ranks."""

import textwrap
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .batches import token_index
from .data import concat_batches, document_targets
from .layouts import PackedLayout
from .measuring.bound import pairs_scored
from .measuring.compiling import compile_counter

__all__ = ["check_documents_apart", "check_targets", "check_positions", "failure_message", "deal_to_ranks",
           "rank_tokens", "token_imbalance", "step_load", "token_loss_sum", "compiled_graphs", "data_parallel_step",
           "one_process_gradients", "check_same_gradients", "wrap_model", "nccl_ranks"]

# --- the three packing checks -------------------------------------------------------


def check_documents_apart(model, document, pack, backend=None):
    """Raise ``AssertionError`` unless two copies of ``document`` (``bytes``)
    packed by ``pack`` (a function of a list of documents that returns packed
    tokens and offsets, like ``pack_documents``) give the same logits: the
    second copy must not attend to the first. Returns the largest difference."""
    tokens, offsets = pack([document, document])
    n = len(document)
    with torch.no_grad():
        logits = model(tokens, token_index(offsets)[1], PackedLayout.of(offsets, backend))
    gap = (logits[:n] - logits[n:]).abs().max().item()
    assert gap < 1e-4, (
        f"two identical documents in one pack give different logits (largest difference "
        f"{gap:.2f}): the second attends to the first; offsets {offsets.tolist()}"
    )
    return gap


def check_targets(tokens, targets, offsets):
    """Raise ``AssertionError`` unless ``targets`` are each token's next token
    within its document and -100 at each document's last token: the first
    token of a document is never the target of the one before it."""
    for i, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if end == start:
            continue
        last = int(targets[end - 1])
        assert last == -100, (
            f"the last token of document {i} (token {end - 1}) has target {last}"
            + (", the first token of the next document" if end < len(tokens) else "")
            + ": a document is trained to predict the one after it"
        )
        assert torch.equal(targets[start : end - 1], tokens[start + 1 : end]), (
            f"document {i}: the targets inside it are not its own next tokens"
        )


def check_positions(positions, offsets):
    """Raise ``AssertionError`` unless ``positions`` restart at 0 at every
    document and count up inside it."""
    expected = token_index(offsets)[1]
    wrong = (positions != expected).nonzero().flatten()
    if len(wrong):
        t = int(wrong[0])
        doc = int(torch.searchsorted(offsets, t, right=True)) - 1
        raise AssertionError(
            f"token {t} (document {doc}, which starts at token {int(offsets[doc])}) has "
            f"position {int(positions[t])}, expected {int(expected[t])}: positions must "
            "restart at 0 at every document"
        )


def failure_message(check, *args, width=110):
    """Run ``check(*args)`` on a wrong variant, which it must refuse, and
    return the ``AssertionError`` message it fails with, wrapped to ``width``
    characters and indented for printing under the line it explains. Raise
    ``AssertionError`` if the check passes: the mistake went unnoticed."""
    try:
        check(*args)
    except AssertionError as failure:
        return "\n".join(textwrap.wrap(str(failure), width, initial_indent="  ", subsequent_indent="    "))
    raise AssertionError(f"{check.__name__} accepted the wrong variant: it would not catch the mistake")


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
    return [[micro_batches[s + r : s + per_step : world] for r in range(world)]
            for s in range(0, len(micro_batches) - per_step + 1, per_step)]


def rank_tokens(steps):
    """The tokens each rank holds in each step of :func:`deal_to_ranks`: an
    int64 tensor (steps, ranks)."""
    per_rank = [[sum(len(t) for t, _ in rank) for rank in step] for step in steps]
    return torch.tensor(per_rank, dtype=torch.int64).reshape(len(steps), len(steps[0]) if steps else 0)


def token_imbalance(steps):
    """The tokens of each step's busiest rank over the mean of its ranks,
    summed over the steps (of :func:`deal_to_ranks`): the factor by which the
    steps take longer than with perfectly balanced work, 1.0 when every rank
    holds the same tokens in every step."""
    per_rank = rank_tokens(steps).double()  # (steps, ranks)
    if per_rank.numel() == 0 or per_rank.sum() == 0:
        raise ValueError(f"no tokens in {len(steps)} steps: deal_to_ranks had fewer micro-batches "
                         "than one step takes (world * per_rank)")
    return float(per_rank.max(1).values.sum() / per_rank.mean(1).sum())


def step_load(steps):
    """What the steps of :func:`deal_to_ranks` hold, as named values: the
    ``tokens`` of every rank and the query-key ``pairs`` that causal attention
    scores (each sequence on its own), both per step, averaged over the
    steps, and the steps' ``imbalance`` (:func:`token_imbalance`)."""
    imbalance = token_imbalance(steps)  # refuses steps without tokens
    micro_batches = [mb for step in steps for rank in step for mb in rank]
    return {"tokens": sum(len(t) for t, _ in micro_batches) / len(steps),
            "pairs": sum(pairs_scored(o.diff(), o.diff(), True) for _, o in micro_batches) / len(steps),
            "imbalance": imbalance}


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


def compiled_graphs(model, micro_batches, layout_of, *, dynamic=None, dtype=torch.float32):
    """What ``torch.compile(model, fullgraph=True)`` does over the forward and
    backward of each micro-batch ``(tokens, offsets)``, the attention layout
    built outside the model by ``layout_of(tokens, offsets)``: a
    :class:`~ragged_toolkit.measuring.compiling.CompileCount` (graphs, breaks,
    uncompiled fallbacks). ``dynamic`` is ``torch.compile``'s. Dynamo's own
    ``eager`` backend runs each graph as captured (no kernels generated);
    dynamo is reset before and after, so the count is this call's, and its
    recompile limit is lifted to 64 (past 8 versions of a function it would
    stop compiling it). The gradients are dropped."""
    torch._dynamo.reset()
    runner = torch.compile(model, backend="eager", fullgraph=True, dynamic=dynamic)
    try:
        with torch._dynamo.config.patch(recompile_limit=64), compile_counter() as count:
            for tokens, offsets in micro_batches:
                loss, targets = token_loss_sum(runner, tokens, offsets, dtype=dtype,
                                               layout=layout_of(tokens, offsets))
                (loss / targets).backward()
    finally:
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
    return count


def data_parallel_step(model, micro_batches, sync=None, *, reduce_count=True, backend=None,
                       dtype=torch.float32):
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


def one_process_gradients(model, micro_batches, backend=None):
    """The reference for a data-parallel step: the gradients of the mean
    next-token loss over every micro-batch of every rank, packed as one batch
    in this process (float32). ``{name: gradient}``."""
    tokens, offsets = concat_batches(micro_batches)
    model.zero_grad(set_to_none=True)
    logits = model(tokens, token_index(offsets)[1], PackedLayout.of(offsets, backend)).float()
    F.cross_entropy(logits, document_targets(tokens, offsets), ignore_index=-100).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def check_same_gradients(grads, reference, tol=1e-4):
    """Raise ``AssertionError`` unless every gradient in ``grads`` is within
    ``tol`` of the one in ``reference``; returns the largest difference."""
    gaps = {n: (grads[n].float().cpu() - g.float().cpu()).abs().max().item() for n, g in reference.items()}
    name = max(gaps, key=gaps.get)
    assert gaps[name] <= tol, (
        f"the data-parallel gradients differ from one process on the whole batch: "
        f"max difference {gaps[name]:.1e} (in {name}) > {tol:.0e}"
    )
    return gaps[name]


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


def nccl_ranks(gpus, micro_batches):
    """How many ranks run over NCCL on a machine with ``gpus`` GPUs: one per
    GPU, at most one per micro-batch; None with fewer than two GPUs, where a
    lone rank's collectives exchange nothing and a data-parallel figure would
    mean nothing."""
    return min(gpus, micro_batches) if gpus > 1 else None
