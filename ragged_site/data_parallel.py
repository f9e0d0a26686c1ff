"""What the data-parallel page proves and counts beside the training code of
:mod:`ragged_toolkit.data_parallel`: the three packing checks and how a
check's failure reads, the load of a step, the graphs a compiled step makes,
one process's gradients as the reference for the ranks', and how many NCCL
ranks a machine runs. The site's machinery, not code to copy."""

import textwrap

import torch
import torch.nn.functional as F

from ragged_toolkit.batches import token_index
from ragged_toolkit.data import concat_batches, document_targets
from ragged_toolkit.data_parallel import token_loss_sum
from ragged_toolkit.layouts import PackedLayout

from .measuring.bound import pairs_scored
from .measuring.compiling import compile_counter

__all__ = [
    "check_documents_apart",
    "check_targets",
    "check_positions",
    "failure_message",
    "step_load",
    "compiled_graphs",
    "one_process_gradients",
    "check_same_gradients",
    "nccl_ranks",
    "rank_tokens",
    "token_imbalance",
]


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
        return "\n".join(
            textwrap.wrap(str(failure), width, initial_indent="  ", subsequent_indent="    ")
        )
    raise AssertionError(
        f"{check.__name__} accepted the wrong variant: it would not catch the mistake"
    )


def step_load(steps):
    """What the steps of :func:`~ragged_toolkit.data_parallel.deal_to_ranks` hold, as named values: the
    ``tokens`` of every rank and the query-key ``pairs`` that causal attention
    scores (each sequence on its own), both per step, averaged over the
    steps, and the steps' ``imbalance`` (:func:`token_imbalance`)."""
    imbalance = token_imbalance(steps)  # refuses steps without tokens
    micro_batches = [mb for step in steps for rank in step for mb in rank]
    return {
        "tokens": sum(len(t) for t, _ in micro_batches) / len(steps),
        "pairs": sum(pairs_scored(o.diff(), o.diff(), True) for _, o in micro_batches) / len(steps),
        "imbalance": imbalance,
    }


def compiled_graphs(model, micro_batches, layout_of, *, dynamic=None, dtype=torch.float32):
    """What ``torch.compile(model, fullgraph=True)`` does over the forward and
    backward of each micro-batch ``(tokens, offsets)``, the attention layout
    built outside the model by ``layout_of(tokens, offsets)``: a
    :class:`~ragged_site.measuring.compiling.CompileCount` (graphs, breaks,
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
                loss, targets = token_loss_sum(
                    runner, tokens, offsets, dtype=dtype, layout=layout_of(tokens, offsets)
                )
                (loss / targets).backward()
    finally:
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
    return count


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
    gaps = {
        n: (grads[n].float().cpu() - g.float().cpu()).abs().max().item()
        for n, g in reference.items()
    }
    name = max(gaps, key=gaps.get)
    assert gaps[name] <= tol, (
        f"the data-parallel gradients differ from one process on the whole batch: "
        f"max difference {gaps[name]:.1e} (in {name}) > {tol:.0e}"
    )
    return gaps[name]


def nccl_ranks(gpus, micro_batches):
    """How many ranks run over NCCL on a machine with ``gpus`` GPUs: one per
    GPU, at most one per micro-batch; None with fewer than two GPUs, where a
    lone rank's collectives exchange nothing and a data-parallel figure would
    mean nothing."""
    return min(gpus, micro_batches) if gpus > 1 else None


def rank_tokens(steps):
    """The tokens each rank holds in each step of :func:`~ragged_toolkit.data_parallel.deal_to_ranks`: an
    int64 tensor (steps, ranks)."""
    per_rank = [[sum(len(t) for t, _ in rank) for rank in step] for step in steps]
    return torch.tensor(per_rank, dtype=torch.int64).reshape(
        len(steps), len(steps[0]) if steps else 0
    )


def token_imbalance(steps):
    """The tokens of each step's busiest rank over the mean of its ranks,
    summed over the steps (of :func:`~ragged_toolkit.data_parallel.deal_to_ranks`): the factor by which the
    steps take longer than with perfectly balanced work, 1.0 when every rank
    holds the same tokens in every step."""
    per_rank = rank_tokens(steps).double()  # (steps, ranks)
    if per_rank.numel() == 0 or per_rank.sum() == 0:
        raise ValueError(
            f"no tokens in {len(steps)} steps: deal_to_ranks had fewer micro-batches "
            "than one step takes (world * per_rank)"
        )
    return float(per_rank.max(1).values.sum() / per_rank.mean(1).sum())
