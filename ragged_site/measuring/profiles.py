"""Where a call's time goes: a profile of its steady state, per call, beside
its timed median, with the profiler's own overhead estimated. (The kernels
that ran and the peak memory of one call, which ``measure`` reports, are
:func:`~ragged_site.measuring.timing.profile_call`.)"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ragged_toolkit.clock import synchronize
from ragged_site.measuring.timing import TIMING_THREADS, cpu_threads, measure
from ragged_toolkit.clock import stopwatch

__all__ = ["profiler_overhead_us", "Profile", "where_time_goes"]


def profiler_overhead_us(n=2000):
    """What the profiler adds per operator it records, in microseconds: a
    loop of ``n`` trivial operators timed with and without it, twice each
    (the fastest of each kept)."""
    from torch.profiler import ProfilerActivity, profile

    x, plain, profiled = torch.zeros(1), [], []
    with cpu_threads(TIMING_THREADS):
        for _ in range(2):
            for times, context in (
                (plain, cpu_threads(None)),
                (profiled, profile(activities=[ProfilerActivity.CPU])),
            ):
                with context, stopwatch() as watch:
                    for _ in range(n):
                        x.add_(0)
                times.append(watch.seconds)
    return max(min(profiled) - min(plain), 0.0) / n * 1e6


@dataclass
class Profile:
    """A profile of ``calls`` steady-state calls (after warm-up), per call: the
    wall time under the profiler, the operators' own time summed, the
    operators recorded and the profiler's estimated overhead for them, the
    median of the timing without the profiler it describes, and the top
    operators as (name, ms per call, share of the operators' time, calls per call)."""

    calls: int
    wall_ms: float
    self_ms: float
    events: float
    overhead_ms: float
    median_ms: float
    rows: list

    def __str__(self):
        lines = [
            f"  per call, {self.calls} calls after warm-up: {self.wall_ms:.2f} ms under the "
            f"profiler, of which up to about {self.overhead_ms:.2f} ms is its overhead",
            f"  ({self.events:.0f} operators); the timed median is {self.median_ms:.2f} ms. "
            f"Operators' own time: {self.self_ms:.2f} ms per call",
        ]
        lines += [
            f"  {name[:52]:52s} {ms:8.3f} ms {share:5.1f}%  x{count:g}"
            for name, ms, share, count in self.rows
        ]
        return "\n".join(lines)


def where_time_goes(fn, top=6, *, timing=None, overhead_us=None, warmup=1, threads=TIMING_THREADS):
    """Profile ``fn`` at its steady state, as it was timed: ``warmup`` calls
    first, then enough calls for about 0.2 s, with ``threads``; every figure
    is per call. ``timing``: the ``Timing`` of ``fn`` from ``measure`` (else
    ``fn`` is timed here), whose median the profile is printed beside;
    ``overhead_us``: :func:`profiler_overhead_us`, measured once by the
    caller for several profiles (else here). Returns a :class:`Profile`;
    printed, the operators that took most time."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    overhead_us = profiler_overhead_us() if overhead_us is None else overhead_us
    if timing is None:
        timing = measure({"fn": fn}, min_run_time=0.2, profile=False, threads=threads)["fn"]
    calls = int(min(50, max(1, 200 / max(timing.median_ms, 1e-3))))
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with cpu_threads(threads):
        for _ in range(warmup):
            fn()
        synchronize()
        with profile(activities=activities) as prof, stopwatch() as watch:
            for _ in range(calls):
                fn()
    rows = prof.key_averages()
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(own(e) for e in rows) or 1
    events = sum(e.count for e in rows) / calls
    return Profile(
        calls=calls,
        wall_ms=watch.seconds * 1e3 / calls,
        self_ms=sum(e.self_cpu_time_total for e in rows) / 1e3 / calls,
        events=events,
        overhead_ms=events * overhead_us / 1e3,
        median_ms=timing.median_ms,
        rows=[
            (e.key, own(e) / 1e3 / calls, 100 * own(e) / total, e.count / calls)
            for e in sorted(rows, key=own, reverse=True)[:top]
        ],
    )
