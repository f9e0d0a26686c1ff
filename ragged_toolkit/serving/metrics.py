"""What a serving run measured: throughput (over runs, and its spread from
run to run), the slot bound of static batches, time to first token and
time per output token."""

from __future__ import annotations

import numpy as np

from ..measuring.timing import Timing

__all__ = ["tokens_per_second", "ms_per_token", "slot_bound", "latency_ms"]


def tokens_per_second(runs):
    """Generated tokens over busy seconds (time stepping), over ``runs``."""
    tokens = sum(r.n_out for run in runs for r in run.requests)
    return tokens / sum(s.seconds for run in runs for s in run.steps)


def ms_per_token(runs):
    """The spread of throughput from run to run: a
    :class:`~ragged_toolkit.measuring.timing.Timing` of each run's busy
    milliseconds per generated token (median, IQR, percentiles 25 and 75,
    the number of runs), for the noise rule (``outside_noise``). A rate in
    tokens/s is ``1000 / ms``: the median's, and an IQR from ``1000 / q3_ms``
    to ``1000 / q1_ms``."""
    return Timing.of([1e3 * sum(s.seconds for s in run.steps) / sum(r.n_out for r in run.requests)
                      for run in runs])


def slot_bound(run):
    """What idle slots cost a static run: slot-steps (its slots times its
    steps) over the tokens it generated."""
    slots = max(s.running for s in run.steps)
    return slots * len(run.steps) / sum(r.n_out for r in run.requests)


def latency_ms(requests):
    """Percentiles 50 and 99, in ms, of the time to first token (from
    arrival) and of the time per output token after the first:
    ``{"ttft": (p50, p99), "tpot": (p50, p99)}``."""
    ttft = [r.first_token_s - r.arrival for r in requests]
    tpot = [(r.finish_s - r.first_token_s) / (r.n_out - 1) for r in requests if r.n_out > 1]
    return {name: tuple(np.percentile(np.array(x) * 1e3, [50, 99]).tolist())
            for name, x in (("ttft", ttft), ("tpot", tpot))}
