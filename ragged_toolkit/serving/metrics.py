"""What a serving run measured: throughput, the slot bound of static
batches, time to first token and time per output token."""

from __future__ import annotations

import numpy as np

__all__ = ["tokens_per_second", "slot_bound", "latency_ms"]


def tokens_per_second(runs):
    """Generated tokens over busy seconds (time stepping), over ``runs``."""
    tokens = sum(r.n_out for run in runs for r in run.requests)
    return tokens / sum(s.seconds for run in runs for s in run.steps)


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
