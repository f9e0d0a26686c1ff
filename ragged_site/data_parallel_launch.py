"""Starting packed training on several ranks: a job (:class:`DataParallelJob`),
the script each rank runs (:func:`data_parallel_worker`), and the launcher
(:func:`run_data_parallel`) that starts the ranks with
``torch.distributed.run``, on the loopback interface when they share one
machine, and reads back what each measured, or each rank's own error."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ragged_toolkit.data_parallel import data_parallel_step, wrap_model
from ragged_toolkit.gpt import GPT, GPTConfig
from ragged_toolkit.clock import stopwatch

__all__ = [
    "GradientRun",
    "DataParallelJob",
    "data_parallel_worker",
    "run_data_parallel",
    "step_times_ms",
]


@dataclass
class GradientRun:
    """One data-parallel step whose gradients are kept: named ``name``, the
    model wrapped ``"ddp"`` or ``"fsdp"``, the target count summed over the
    ranks or not (``reduce_count=False``: the usual mistake)."""

    name: str
    wrap: str
    reduce_count: bool = True


@dataclass
class DataParallelJob:
    """What every rank does: the process group's ``backend`` (``"gloo"``,
    CPU ranks, or ``"nccl"``, a GPU each), the model (``GPTConfig`` fields),
    the dtype of the timed steps, AdamW's learning rate, the gradient runs
    and the attention backends of the gradient check and of the timed steps."""

    backend: str
    config: dict
    dtype: str = "float32"
    lr: float = 1e-3
    grad_runs: list = field(default_factory=list)  # of GradientRun
    grad_backend: str = "loop"
    time_backend: str = "loop"

    @classmethod
    def from_json(cls, text):
        job = json.loads(text)
        return cls(**{**job, "grad_runs": [GradientRun(**r) for r in job["grad_runs"]]})


#: The script each rank runs, ``worker.py``: it calls :func:`data_parallel_worker`.
DATA_PARALLEL_SCRIPT = """\
import faulthandler
import os
import sys

faulthandler.enable(all_threads=True)  # a rank that aborts prints where each thread was

from ragged_site.data_parallel_launch import data_parallel_worker

data_parallel_worker(sys.argv[1])
# Done, and everything written: leave without the interpreter's teardown,
# where C++ objects that still held a gloo connection were seen to abort
# (rank 0, about one launch in 50, with no Python frame on the stack).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def data_parallel_worker(folder):
    """One rank of :func:`run_data_parallel`, started by ``torch.distributed.run``
    (which sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``). Reads
    ``job.json`` and ``data.pt`` from ``folder``; runs the gradient runs
    (rank 0 saves the whole gradients) and the timed steps; writes
    ``rank<R>.json``, what this rank measured, or ``rank<R>.error``, the
    traceback it stopped with. The ranks leave together
    (``_leave_together``) before the process group is destroyed; a rank
    that fails destroys nothing (the launcher stops the others)."""
    folder, rank = Path(folder), int(os.environ["RANK"])
    job = DataParallelJob.from_json((folder / "job.json").read_text())
    data = torch.load(folder / "data.pt", weights_only=True)
    device = _init_rank(job)
    try:
        report = {
            "rank": rank,
            "world_size": dist.get_world_size(),
            "backend": job.backend,
            "device": str(device),
            "threads": torch.get_num_threads(),
        }
        _gradient_runs(job, data, device, folder, rank)
        report["timing"] = _timed_steps(job, data, device, rank)
        dist.barrier()  # the last collective: every rank is done with the others
    except BaseException:
        import traceback

        (folder / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    _leave_together(folder, rank, dist.get_world_size())
    gc.collect()  # the wrapped models' cycles, which hold the process group, go first
    dist.destroy_process_group()
    (folder / f"rank{rank}.json").write_text(json.dumps(report))


def _leave_together(folder, rank, world, timeout_s=120.0):
    # Wait, outside the process group, until every rank has returned from the
    # last collective. A gloo barrier alone is not enough: a rank that leaves
    # it first and tears its connections down can close a socket while its
    # peer still sends the barrier's last message, and the peer aborts
    # ("terminate called without an active exception"; gloo issue 155). Ranks
    # on one machine share the job's folder: each marks itself done there.
    (folder / f"rank{rank}.done").touch()
    deadline = time.monotonic() + timeout_s
    while not all((folder / f"rank{r}.done").exists() for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank}: the other ranks did not finish within {timeout_s:.0f} s"
            )
        time.sleep(0.01)


def _init_rank(job):
    cuda = job.backend == "nccl"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # the check compares in float32
    dist.init_process_group(job.backend, device_id=device if cuda else None)
    return device


def _fresh_model(job, data, how, device):
    # the shared initial weights, wrapped: (model, what to call, sync)
    model = GPT(GPTConfig(**job.config)).to(device)
    model.load_state_dict(data["init"])
    return (model, *wrap_model(model, how, device))


def _gradient_runs(job, data, device, folder, rank):
    mine = [(t.to(device), o.to(device)) for t, o in data["grad_batches"][rank]]
    for run in job.grad_runs:
        model, runner, sync = _fresh_model(job, data, run.wrap, device)
        data_parallel_step(
            runner, mine, sync, reduce_count=run.reduce_count, backend=job.grad_backend
        )
        grads = {
            n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for n, p in model.named_parameters()
        }  # FSDP2 holds shards: gather
        if rank == 0:
            torch.save({n: g.cpu() for n, g in grads.items()}, folder / f"grads-{run.name}.pt")


def _timed_steps(job, data, device, rank):
    # each scheme's training steps under DDP with AdamW, each timed between barriers
    timing, dtype = {}, getattr(torch, job.dtype)
    for scheme, steps in data["time_batches"].items():
        model, runner, sync = _fresh_model(job, data, "ddp", device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
        seconds, tokens = [], []
        for step in steps:  # step[rank]: this rank's micro-batches
            batches = [(t.to(device), o.to(device)) for t, o in step[rank]]
            dist.barrier()
            with stopwatch() as watch:
                optimizer.zero_grad(set_to_none=True)
                data_parallel_step(runner, batches, sync, backend=job.time_backend, dtype=dtype)
                optimizer.step()
            seconds.append(watch.seconds)
            tokens.append(sum(len(t) for t, _ in batches))
        timing[scheme] = {"seconds": seconds, "tokens": tokens}
    return timing


def _launch_command(nproc, script="worker.py", folder="FOLDER", log_dir=None):
    """The command that starts ``nproc`` ranks of the worker script on this
    machine (``torchrun --standalone --nproc-per-node=N`` is the same);
    with ``log_dir``, each rank's standard output and error go to files of
    their own there (``--redirects 3``)."""
    logs = ["--log-dir", str(log_dir), "--redirects", "3"] if log_dir else []
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *logs,
        script,
        folder,
    ]


def _rank_errors(folder, nproc):
    # each rank's own error: its traceback where it wrote one, else the end
    # of its standard error (an abort leaves no traceback)
    found = []
    for r in range(nproc):
        error = folder / f"rank{r}.error"
        logs = sorted((folder / "logs").glob(f"**/{r}/stderr.log"))
        text = error.read_text() if error.exists() else (logs[-1].read_text() if logs else "")
        if text.strip():
            found.append((f"rank{r}", "\n".join(text.strip().splitlines()[-20:])))
    return found


def run_data_parallel(job, data, nproc, *, timeout=600):
    """Launch :func:`data_parallel_worker` on ``nproc`` ranks with
    ``_launch_command``, in a temporary folder that holds the job
    (a :class:`DataParallelJob`) and the worker script; the ranks import this
    package from where this process does, and talk over the loopback
    interface. Ranks over ``gloo`` run on the CPU and see no GPU. On failure
    it raises with each rank's own error. Returns the ranks' reports in rank
    order and the gradients of each gradient run, ``{name: {parameter: gradient}}``."""
    package_parent = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix="data-parallel-") as name:
        folder = Path(name)
        (folder / "worker.py").write_text(DATA_PARALLEL_SCRIPT)
        (folder / "job.json").write_text(json.dumps(dataclasses.asdict(job)))
        torch.save(data, folder / "data.pt")
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "MASTER_ADDR": "127.0.0.1",
            "PYTHONPATH": os.pathsep.join(
                filter(None, [package_parent, os.environ.get("PYTHONPATH")])
            ),
        }
        if job.backend == "gloo":
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: no accelerator to build a mesh on
        command = _launch_command(nproc, folder=str(folder), log_dir=folder / "logs")
        proc = subprocess.run(
            command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            errors = _rank_errors(folder, nproc)
            shown = (
                "\n".join(f"--- {who}:\n{text}" for who, text in errors)
                or (proc.stdout + proc.stderr)[-3000:]
            )
            where = ", " + ", ".join(who for who, _ in errors) if errors else ""
            raise RuntimeError(
                f"{nproc} ranks on {job.backend} failed (exit {proc.returncode}{where}):\n{shown}"
            )
        reports = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(nproc)]
        grads = {
            run.name: torch.load(folder / f"grads-{run.name}.pt", weights_only=True)
            for run in job.grad_runs
        }
    return reports, grads


def step_times_ms(reports, scheme, skip=0):
    """Each timed step of ``scheme`` in ms, read from the ranks' reports
    (:func:`run_data_parallel`): the slowest rank's time, since a step ends
    for every rank when the slowest has sent its gradients. The first
    ``skip`` steps (the warm-up) are left out. A list of floats, one a step."""
    seconds = [report["timing"][scheme]["seconds"][skip:] for report in reports]
    if not seconds or len({len(s) for s in seconds}) != 1:
        raise ValueError(
            f"timed steps of {scheme!r} per rank after the first {skip}: "
            f"{[len(s) for s in seconds]}; every rank of one run times the same steps"
        )
    return [1e3 * max(step) for step in zip(*seconds)]
