"""Timings that can be trusted, and choices made only outside their noise.

:func:`measure` times functions side by side (``torch.utils.benchmark``,
interleaved rounds, median and interquartile range), with the peak memory and
the attention kernels of one more call (:func:`profile_call`);
:func:`choose` picks the fastest only outside the noise; :class:`StepTimer`
times the steps of a training loop; :func:`compile_counter` counts what
``torch.compile`` did.
"""

import gc
import logging
import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils import benchmark

from .device import synchronize

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


# --- the kernel that ran, and the memory a call needs --------------------------

KERNELS = {  # profiler operator -> the kernel it names
    "aten::_scaled_dot_product_flash_attention_for_cpu": "CPU flash",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_flash_attention_forward": "flash varlen",
    "aten::_efficient_attention_forward": "memory-efficient varlen",
    "aten::_cudnn_attention_forward": "cuDNN varlen",
}


def kernel_label(events):
    """The attention kernels among profiler events, with their call counts
    (empty if no attention ran): "CPU flash x12", "flash varlen"."""
    counts = {}
    for e in events:
        base = e.name.removesuffix("_backward")
        parent = e.cpu_parent
        while parent is not None and parent.name.removesuffix("_backward") not in KERNELS:
            parent = parent.cpu_parent
        if base in KERNELS and parent is None:  # not called by another attention op
            label = KERNELS[base] + (" backward" if e.name.endswith("_backward") else "")
            counts[label] = counts.get(label, 0) + 1
    if not counts and any(e.name.startswith("triton_tem_fused") for e in events):
        counts["FlexAttention Triton kernel"] = 1
    if not counts and any(e.name.startswith("Torch-Compiled Region") for e in events):
        counts["compiled graph (inductor kernel)"] = 1
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items())


def profile_call(fn, threads=TIMING_THREADS):
    """Run ``fn`` once under the profiler (with ``threads``, as it was timed):
    the memory it needed beyond what was allocated before, in MiB, and the
    attention kernels that ran (:func:`kernel_label`)."""
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
        sizes = [n for _, n in sorted((e.start_ns(), e.nbytes())
                                      for e in prof.profiler.kineto_results.events()
                                      if e.name() == "[memory]")]
        peak = max(float(np.cumsum(sizes).max()), 0.0) if sizes else 0.0
    return peak / 2**20, kernel_label(prof.events())


# --- timings ----------------------------------------------------------------------


@dataclass
class Timing:
    """Median and IQR of the timed runs in ms, the first call in s, peak
    memory in MiB, the attention kernels that ran, and the percentiles 25 and 75."""

    median_ms: float
    iqr_ms: float
    first_call_s: float
    peak_mib: float = float("nan")
    kernels: str = ""
    q1_ms: float = float("nan")  # percentiles 25 and 75 of the timed runs
    q3_ms: float = float("nan")
    runs: int = 0  # how many timed runs (blocks) the percentiles come from; 0: unknown

    @classmethod
    def of(cls, samples_ms):
        """The Timing of a list of timed runs in ms (steps of a loop, say)."""
        q1, median, q3 = np.percentile(samples_ms, [25, 50, 75])
        return cls(median, q3 - q1, float("nan"), q1_ms=q1, q3_ms=q3, runs=len(samples_ms))

    def __str__(self):
        memory = "" if self.peak_mib != self.peak_mib else f"  peak {self.peak_mib:7.1f} MiB"  # NaN: not measured
        kernels = f"  [{self.kernels}]" if self.kernels else ""
        return f"{self.median_ms:9.2f} ms (IQR {self.iqr_ms:6.2f}){memory}{kernels}"


def measure(fns, *, min_run_time=1.0, rounds=3, profile=True, threads=TIMING_THREADS):
    """Time callables side by side. ``fns`` maps a name to a function of no
    arguments; each first call is timed alone (it may compile), then the
    functions take turns for ``rounds`` rounds, so that a busy machine slows
    all alike. Returns name -> :class:`Timing`."""
    first, times = {}, {name: [] for name in fns}
    with cpu_threads(threads):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            synchronize()
            first[name] = time.perf_counter() - start
        for _ in range(rounds):
            for name, fn in fns.items():
                timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
                times[name] += timer.blocked_autorange(min_run_time=min_run_time / rounds).times
    out = {}
    for name, fn in fns.items():
        timing = Timing.of(np.array(times[name]) * 1e3)
        timing.first_call_s = first[name]
        if profile:
            timing.peak_mib, timing.kernels = profile_call(fn, threads)
        out[name] = timing
    return out


def print_timings(results):
    """One line per entry of ``results`` (name -> :class:`Timing`, or the
    reason it did not run), names aligned."""
    width = max(map(len, results), default=0)
    for name, r in results.items():
        print(f"  {name:{width}s} {r}" if isinstance(r, Timing) else f"  {name:{width}s} not available: {r}")


def outside_noise(a, b):
    """Whether two :class:`Timing` s differ by more than their spread: their
    interquartile ranges, ``[q1, q3]``, do not overlap."""
    return a.q3_ms < b.q1_ms or b.q3_ms < a.q1_ms


#: The fewest timed runs per option from which :func:`choose` names a winner.
MIN_RUNS = 5


def choose(results, default, what="choice"):
    """Choose among measured options only where the measurement can tell.

    The rule: the options are timed in interleaved rounds (:func:`measure`);
    the one with the lowest median wins only if its interquartile range does
    not overlap that of the second fastest. Otherwise the difference is
    within noise and the documented default is returned (so it is, too, when
    either has fewer than :data:`MIN_RUNS` timed runs): ``default``, a name or
    a tuple of names in order of preference, the first of them that ran and
    is within the noise of the fastest. ``results``: name -> :class:`Timing`
    (or the reason it did not run). Prints what was chosen and why; returns
    the name."""
    timed = {n: r for n, r in results.items() if isinstance(r, Timing)}
    ranked = sorted(timed, key=lambda n: timed[n].median_ms)
    if not ranked:
        raise ValueError(f"nothing to choose from for {what}: none of {list(results)} ran")

    def q(n):
        t = timed[n]
        return f"{n} {t.median_ms:.2f} ms (IQR {t.q1_ms:.2f}-{t.q3_ms:.2f})"

    best = ranked[0]
    if len(ranked) == 1:
        print(f"{what}: chosen {best}, the only option that ran")
        return best
    runner = ranked[1]
    gap = timed[runner].q1_ms - timed[best].q3_ms
    few = [n for n in (best, runner) if 0 < timed[n].runs < MIN_RUNS]
    defaults = (default,) if isinstance(default, str) else tuple(default)
    if gap > 0 and few:
        pick = next((d for d in defaults if d in timed), best)
        print(f"{what}: too few timed runs to tell ({', '.join(few)}: under {MIN_RUNS}), chosen {pick}")
        return pick
    if gap > 0:
        print(f"{what}: chosen {best}, outside the noise")
        print(f"  {q(best)} against {q(runner)}: {gap:.2f} ms between the IQRs")
        return best
    tied = [n for n in ranked if not outside_noise(timed[best], timed[n])]
    pick = next((d for d in defaults if d in tied), best)
    why = "the default" if pick in defaults else "no default among them: the lowest median"
    print(f"{what}: within noise, chosen {pick} ({why})")
    more = f", and {len(tied) - 2} more" if len(tied) > 2 else ""
    print("  IQRs overlap: " + ", ".join(q(n) for n in tied[:2]) + more)
    return pick


# --- what torch.compile did --------------------------------------------------------


def compile_totals():
    """Graphs compiled and graph breaks so far in this process, from dynamo's
    counters: ``(graphs, breaks)``."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@dataclass
class CompileCount:
    """What ``torch.compile`` did while a :func:`compile_counter` was open: the
    graphs it compiled, the graph breaks, the batch shapes noted with
    :meth:`saw`, and the warnings that say a compiled function ran without
    compiling instead."""

    graphs: int = 0
    breaks: int = 0
    shapes: set = field(default_factory=set)
    fallbacks: list = field(default_factory=list)

    def saw(self, shape):
        """Note one batch shape (a tuple of sizes, or any value usable as a set member)."""
        self.shapes.add(shape)

    def __str__(self):
        fell = f"; {len(self.fallbacks)} uncompiled fallbacks" if self.fallbacks else ""
        shapes = f" for {len(self.shapes)} batch shape{'s' * (len(self.shapes) != 1)}" if self.shapes else ""
        return (f"{self.graphs} graph{'s' * (self.graphs != 1)} compiled{shapes}, "
                f"{self.breaks} graph break{'s' * (self.breaks != 1)}{fell}")


FALLBACK_NOTES = ("called without torch.compile", "recompile_limit", "cache_size_limit")


class _FallbackLog(logging.Handler):
    def __init__(self, count):
        super().__init__(logging.WARNING)
        self.count = count

    def emit(self, record):
        if any(n in record.getMessage() for n in FALLBACK_NOTES):
            self.count.fallbacks.append(record.getMessage().splitlines()[0][:200])


@contextmanager
def compile_counter():
    """Count what ``torch.compile`` does inside the ``with`` block: yields a
    :class:`CompileCount`, filled when the block ends."""
    count, (graphs, breaks) = CompileCount(), compile_totals()
    handler = _FallbackLog(count)
    log = logging.getLogger("torch._dynamo")
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield count
    finally:
        log.removeHandler(handler)
        now = compile_totals()
        count.graphs, count.breaks = now[0] - graphs, now[1] - breaks
    shown = set()
    for w in caught:  # the others go on, once each, as if not caught
        text = str(w.message)
        if any(n in text for n in FALLBACK_NOTES):
            count.fallbacks.append(text.splitlines()[0][:200])
        elif (text, w.category) not in shown:
            shown.add((text, w.category))
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


class StepTimer:
    """The steps of a training loop, timed: ``with timer.step(tokens): ...``
    synchronizes, times the block, and counts the graphs ``torch.compile``
    compiled and the graph breaks it met inside it."""

    def __init__(self):
        self.seconds, self.tokens, self.graphs, self.breaks = [], [], [], []

    @contextmanager
    def step(self, tokens):
        graphs, breaks = compile_totals()
        synchronize()
        start = time.perf_counter()
        yield
        synchronize()
        self.seconds.append(time.perf_counter() - start)
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
