"""Timings that can be trusted: functions timed side by side in interleaved
rounds with ``torch.utils.benchmark``, one CPU thread per operator; the
steps of a loop timed with the device synchronized at both ends."""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils import benchmark

from ragged_toolkit.clock import stopwatch, synchronize

__all__ = [
    "TIMING_THREADS",
    "cpu_threads",
    "Timing",
    "profile_call",
    "measure",
    "StepTimer",
    "warm_every_shape",
    "train_in_turns",
]

#: The CPU threads per operator that ``measure`` times with and every profile
#: runs with: one, ``torch.utils.benchmark``'s default, so that a profile
#: describes the call that was timed (with two threads on a busy 2-core
#: machine, each parallel region can wait a scheduler slice for a thread that
#: is not running: a 2 ms call then profiles at 300 ms). ``None``: as set.
TIMING_THREADS = 1


@contextmanager
def cpu_threads(n):
    """Run the block with ``n`` CPU threads per operator (``None``: as set)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Timing:
    """Median and IQR of the timed runs in ms, the first call in s, peak
    memory in MiB, the attention kernels that ran, and the percentiles 25 and 75."""

    median_ms: float
    iqr_ms: float
    first_call_s: float = float("nan")
    peak_mib: float = float("nan")
    kernels: str = ""
    q1_ms: float = float("nan")  # percentiles 25 and 75 of the timed runs
    q3_ms: float = float("nan")
    runs: int = 0  # how many timed runs (blocks) the percentiles come from; 0: unknown

    @classmethod
    def of(cls, samples_ms):
        """The Timing of a list of timed runs in ms (steps of a loop, say)."""
        q1, median, q3 = np.percentile(samples_ms, [25, 50, 75])
        return cls(
            float(median), float(q3 - q1), q1_ms=float(q1), q3_ms=float(q3), runs=len(samples_ms)
        )

    def __str__(self):
        memory = (
            "" if self.peak_mib != self.peak_mib else f"  peak {self.peak_mib:7.1f} MiB"
        )  # NaN: not measured
        kernels = f"  [{self.kernels}]" if self.kernels else ""
        return f"{self.median_ms:9.2f} ms (IQR {self.iqr_ms:6.2f}){memory}{kernels}"


_KERNELS = {  # profiler operator -> the kernel it names
    "aten::_scaled_dot_product_flash_attention_for_cpu": "CPU flash",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_flash_attention_forward": "flash varlen",
    "aten::_efficient_attention_forward": "memory-efficient varlen",
    "aten::_cudnn_attention_forward": "cuDNN varlen",
}


def _kernel_label(events):
    """The attention kernels among profiler events, with their call counts
    (empty if no attention ran): "CPU flash x12", "flash varlen"."""
    counts = {}
    for e in events:
        base = e.name.removesuffix("_backward")
        parent = e.cpu_parent
        while parent is not None and parent.name.removesuffix("_backward") not in _KERNELS:
            parent = parent.cpu_parent
        if base in _KERNELS and parent is None:  # not called by another attention op
            label = _KERNELS[base] + (" backward" if e.name.endswith("_backward") else "")
            counts[label] = counts.get(label, 0) + 1
    if not counts and any(e.name.startswith("triton_tem_fused") for e in events):
        counts["FlexAttention Triton kernel"] = 1
    if not counts and any(e.name.startswith("Torch-Compiled Region") for e in events):
        counts["compiled graph (inductor kernel)"] = 1
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items())


def profile_call(fn, threads=TIMING_THREADS):
    """Run ``fn`` once under the profiler (with ``threads``, as it was timed):
    the memory it needed beyond what was allocated before, in MiB, and the
    attention kernels that ran (``_kernel_label``)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # keep the profiler's log lines quiet
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # free what earlier calls left behind before counting
    cuda = torch.cuda.is_available()
    if cuda:
        synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with cpu_threads(threads), profile(activities=activities, profile_memory=not cuda) as prof:
        fn()
        synchronize()
    if cuda:
        peak = torch.cuda.max_memory_allocated() - before
    else:  # the running sum of the allocation and free events, in time order
        sizes = [
            n
            for _, n in sorted(
                (e.start_ns(), e.nbytes())
                for e in prof.profiler.kineto_results.events()
                if e.name() == "[memory]"
            )
        ]
        peak = max(float(np.cumsum(sizes).max()), 0.0) if sizes else 0.0
    return peak / 2**20, _kernel_label(prof.events())


def measure(fns, *, min_run_time=1.0, rounds=3, profile=True, threads=TIMING_THREADS):
    """Time callables side by side. ``fns`` maps a name to a function of no
    arguments; each first call is timed alone (it may compile), then the
    functions take turns for ``rounds`` rounds, so that a busy machine slows
    all alike. With ``profile``, one more call of each under the profiler
    gives its peak memory and the attention kernels that ran
    (:func:`profile_call`). Returns name
    -> :class:`Timing`."""
    first, times = {}, {name: [] for name in fns}
    with cpu_threads(threads):
        for name, fn in fns.items():
            with stopwatch() as watch:
                fn()
            first[name] = watch.seconds
        for _ in range(rounds):
            for name, fn in fns.items():
                timer = benchmark.Timer(
                    "fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
                )
                times[name] += timer.blocked_autorange(min_run_time=min_run_time / rounds).times
    out = {}
    for name, fn in fns.items():
        timing = Timing.of(np.array(times[name]) * 1e3)
        timing.first_call_s = first[name]
        if profile:
            timing.peak_mib, timing.kernels = profile_call(fn, threads)
        out[name] = timing
    return out


class StepTimer:
    """The steps of a training loop, timed: ``with timer.step(tokens): ...``
    times the block with ``stopwatch`` and counts the graphs
    ``torch.compile`` compiled and the graph breaks it met inside it."""

    def __init__(self):
        self.seconds, self.tokens, self.graphs, self.breaks = [], [], [], []

    @contextmanager
    def step(self, tokens):
        from ragged_site.measuring.compiling import compile_totals

        graphs, breaks = compile_totals()
        with stopwatch() as watch:
            yield
        self.seconds.append(watch.seconds)
        self.tokens.append(tokens)
        now = compile_totals()
        self.graphs.append(now[0] - graphs)
        self.breaks.append(now[1] - breaks)

    def tokens_per_s(self, skip=0):
        """Tokens per second over the steps after the first ``skip``."""
        return sum(self.tokens[skip:]) / sum(self.seconds[skip:])

    def per_1k_tokens(self, skip=0):
        """A :class:`Timing` of the steps after the first ``skip``, in ms per
        thousand tokens (so that steps of different sizes compare)."""
        return Timing.of(np.array(self.seconds[skip:]) / np.array(self.tokens[skip:]) * 1e6)


def warm_every_shape(step, batches, shape_of):
    """Call ``step(batch)`` on the first batch of every distinct
    ``shape_of(batch)``, before any timing: on CUDA, SDPA's cuDNN kernel
    builds a plan for each new shape (tens of ms), which must not land in a
    timed step, on either side of a comparison. Returns the shapes met."""
    seen = []
    for batch in batches:
        if shape_of(batch) not in seen:
            seen.append(shape_of(batch))
            step(batch)
    return seen


def train_in_turns(trainers, batches, *, tokens_of, shape_of, warm_first=None):
    """Take turns, one step each: every batch goes to each of ``trainers``
    (name -> a function that takes one training step on a batch and returns
    its loss), each step timed with a :class:`StepTimer` counting
    ``tokens_of(batch)`` tokens. ``warm_first`` (name -> a throwaway trainer
    of the same kind) first meets every batch shape (``shape_of``), before
    any timing, through :func:`warm_every_shape`. Returns name ->
    (``StepTimer``, losses)."""
    for warm in (warm_first or {}).values():
        warm_every_shape(warm, batches, shape_of)
    out = {name: (StepTimer(), []) for name in trainers}
    for batch in batches:
        for name, (timer, losses) in out.items():
            with timer.step(tokens_of(batch)):
                loss = trainers[name](batch)
            losses.append(float(loss.detach()))
    return out
