"""Packed training on several ranks: the checks that a pack trains each
document as if it were alone, a loss normalized over every rank, the DDP and
FSDP2 wrapping, and a launcher for ``torch.distributed.run``."""

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .batches import token_index
from .data import concat_batches, document_targets
from .gpt import GPT, GPTConfig, Packed

# --- the three packing checks -------------------------------------------------------


def check_documents_apart(model, document, pack, backend=None):
    """Raise ``AssertionError`` unless two copies of ``document`` (``bytes``)
    packed by ``pack`` (a function of a list of documents that returns packed
    tokens and offsets, like ``pack_documents``) give the same logits: the
    second copy must not attend to the first. Returns the largest difference."""
    tokens, offsets = pack([document, document])
    n = len(document)
    with torch.no_grad():
        logits = model(tokens, token_index(offsets)[1], Packed(offsets, backend))
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


# --- the loss of a step, on every rank ---------------------------------------------


def token_loss_sum(model, tokens, offsets, backend=None, dtype=torch.float32):
    """The sum of the next-token losses of a packed micro-batch and its
    number of targets (each document's last token has none)."""
    targets = document_targets(tokens, offsets)
    with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(tokens, token_index(offsets)[1], Packed(offsets, backend))  # (T, vocab)
    loss = F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
    return loss, (targets != -100).sum()


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
    logits = model(tokens, token_index(offsets)[1], Packed(offsets, backend)).float()
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


# --- one rank, and the launcher -----------------------------------------------------

#: The script each rank runs, ``worker.py``: it calls :func:`data_parallel_worker`.
DATA_PARALLEL_SCRIPT = """\
import sys

from ragged_toolkit.data_parallel import data_parallel_worker

data_parallel_worker(sys.argv[1])
"""


def data_parallel_worker(folder):
    """One rank of :func:`run_data_parallel`, started by ``torch.distributed.run``
    (which sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``). Reads
    ``job.json`` and ``data.pt`` from ``folder``; for each gradient run, one
    :func:`data_parallel_step` (rank 0 saves the whole gradients); for each
    timed scheme, training steps with AdamW, each timed between barriers.
    Writes ``rank<R>.json``, what this rank measured, or ``rank<R>.error``,
    the traceback it stopped with."""
    folder, rank = Path(folder), int(os.environ["RANK"])
    try:
        report = _run_rank(folder, rank)
    except BaseException:
        import traceback

        (folder / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    (folder / f"rank{rank}.json").write_text(json.dumps(report))


def _run_rank(folder, rank):
    job = json.loads((folder / "job.json").read_text())
    data = torch.load(folder / "data.pt", weights_only=True)
    cuda = job["backend"] == "nccl"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # the check compares in float32
    dist.init_process_group(job["backend"], device_id=device if cuda else None)
    cfg, dtype = GPTConfig(**job["config"]), getattr(torch, job["dtype"])
    wait = torch.cuda.synchronize if cuda else (lambda: None)

    def fresh(how):  # the shared initial weights, wrapped
        model = GPT(cfg).to(device)
        model.load_state_dict(data["init"])
        return (model, *wrap_model(model, how, device))

    report = {"rank": rank, "world_size": dist.get_world_size(), "backend": job["backend"],
              "device": str(device), "threads": torch.get_num_threads(), "timing": {}}
    try:
        mine = [(t.to(device), o.to(device)) for t, o in data["grad_batches"][rank]]
        for run in job["grad_runs"]:
            model, runner, sync = fresh(run["wrap"])
            data_parallel_step(runner, mine, sync, reduce_count=run["reduce_count"], backend=job["grad_backend"])
            grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                     for n, p in model.named_parameters()}  # FSDP2 holds shards: gather
            if rank == 0:
                torch.save({n: g.cpu() for n, g in grads.items()}, folder / f"grads-{run['name']}.pt")
        for scheme, steps in data["time_batches"].items():
            model, runner, sync = fresh("ddp")
            optimizer = torch.optim.AdamW(model.parameters(), lr=job["lr"])
            seconds, tokens = [], []
            for step in steps:  # step[rank]: this rank's micro-batches
                batches = [(t.to(device), o.to(device)) for t, o in step[rank]]
                wait()
                dist.barrier()
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                data_parallel_step(runner, batches, sync, backend=job["time_backend"], dtype=dtype)
                optimizer.step()
                wait()
                seconds.append(time.perf_counter() - start)
                tokens.append(sum(len(t) for t, _ in batches))
            report["timing"][scheme] = {"seconds": seconds, "tokens": tokens}
    finally:
        dist.destroy_process_group()
    return report


def nccl_ranks(gpus, micro_batches):
    """How many ranks run over NCCL on a machine with ``gpus`` GPUs: one per
    GPU, at most one per micro-batch; None with fewer than two GPUs, where a
    lone rank's collectives exchange nothing and a data-parallel figure would
    mean nothing."""
    return min(gpus, micro_batches) if gpus > 1 else None


def data_parallel_command(nproc, script="worker.py", folder="FOLDER"):
    """The command that starts ``nproc`` ranks of the worker script on this
    machine (``torchrun --standalone --nproc-per-node=N`` is the same)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            script, folder]


def run_data_parallel(job, data, nproc, *, timeout=600):
    """Launch :func:`data_parallel_worker` on ``nproc`` ranks with
    :func:`data_parallel_command`, in a temporary folder that holds the job
    and the worker script; the ranks import this package from where this
    process does. Ranks over ``gloo`` run on the CPU and see no GPU. Each
    rank's output is kept out of the caller's; on failure, its last lines are
    raised. Returns the ranks' reports in rank order and the gradients of
    each gradient run, ``{name: {parameter: gradient}}``."""
    package_parent = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix="data-parallel-") as name:
        folder = Path(name)
        (folder / "worker.py").write_text(DATA_PARALLEL_SCRIPT)
        (folder / "job.json").write_text(json.dumps(job))
        torch.save(data, folder / "data.pt")
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
               "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}
        if job["backend"] == "gloo":
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: no accelerator to build a mesh on
        proc = subprocess.run(data_parallel_command(nproc, folder=str(folder)), cwd=folder, env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            errors = sorted(folder.glob("rank*.error"))  # the ranks' own tracebacks
            text = errors[0].read_text() if errors else proc.stdout + proc.stderr
            tail = "\n".join(text.strip().splitlines()[-30:])
            where = f", {errors[0].stem}" if errors else ""
            raise RuntimeError(f"{nproc} ranks on {job['backend']} failed (exit {proc.returncode}{where}):\n{tail}")
        reports = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(nproc)]
        grads = {run["name"]: torch.load(folder / f"grads-{run['name']}.pt", weights_only=True)
                 for run in job["grad_runs"]}
    return reports, grads
