"""The simulated server: a scheduler and the engine stepping over a stream
of requests, on a clock that advances by each step's measured time; several
servers taking turns step by step, so that a busy machine weighs on them
alike."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..measuring.timing import stopwatch
from .engine import forward_step
from .schedulers import retire_finished

__all__ = ["StepRecord", "ServingRun", "serve", "take_turns"]


@dataclass
class StepRecord:
    """A step's measured seconds, prompt (or recomputed) and decode tokens,
    slots taken; after it, requests waiting (arrived), rows used, blocks held."""

    seconds: float
    prefill: int
    decode: int
    running: int
    waiting: int
    used_rows: int
    held_blocks: int


@dataclass
class ServingRun:
    """What a run of :func:`serve` did: its requests and its steps."""

    requests: list
    steps: list


def _record_step(seconds, fed, slots, running, waiting, cache, now):
    """The :class:`StepRecord` of a step that fed ``fed``, a list of
    ``(request, n, whether that was a decode token)``, in ``slots`` slots."""
    decode = sum(n for _, n, was_decode in fed if was_decode)
    arrived = sum(r.arrival <= now for r in waiting)
    return StepRecord(seconds, sum(n for _, n, _ in fed) - decode, decode, slots, arrived,
                      sum(r.computed for r in running), sum(map(len, cache.tables.values())))


def _stamp_clock(requests, now):
    """Note the clock on each request's first token and on its last."""
    for req in requests:
        if req.generated and req.first_token_s is None:
            req.first_token_s = now
        if req.done() and req.finish_s is None:
            req.finish_s = now


def serve(model, requests, cache, plan, retire_step=retire_finished, *, path="gathered",
          backend=None, check=False, observe=None):
    """Serve ``requests`` on a simulated clock that advances by each step's
    measured time and jumps to the next arrival when nothing runs. A generator
    yielding after each step (:func:`take_turns`), returning a
    :class:`ServingRun`. ``plan(running, waiting, cache, now)`` picks a step's
    work, ``retire_step(running, cache)`` ends it; ``check``: verify the
    blocks after each step; ``observe(step, running, cache)``: called after each."""
    waiting, running, steps, now = deque(sorted(requests, key=lambda r: r.arrival)), [], [], 0.0
    while waiting or running:
        if not running and waiting[0].arrival > now:
            now = waiting[0].arrival
        with stopwatch() as watch:
            work = plan(running, waiting, cache, now)
            fed = [(req, n, bool(req.generated) and req.pending() == 1) for req, n in work]
            slots = len(running)
            forward_step(model, cache, work, path, backend)
            retire_step(running, cache)
        now += watch.seconds
        _stamp_clock([req for req, _ in work], now)
        steps.append(_record_step(watch.seconds, fed, slots, running, waiting, cache, now))
        if check:
            cache.check()
        if observe is not None:
            observe(len(steps) - 1, running, cache)
        yield
    return ServingRun(requests, steps)


def take_turns(*starts):
    """Runs of :func:`serve` one step each in turn. ``starts`` are functions
    that start a run (a fresh :func:`serve` generator); a run that ends
    starts again until each has ended once, so that all span the same
    stretch of time and whatever else the machine does weighs on them alike.
    Returns, for each, its finished :class:`ServingRun` s (a repeat still
    running at the end is dropped)."""
    finished, live = [[] for _ in starts], [start() for start in starts]
    while not all(finished):
        for i, run in enumerate(live):
            try:
                next(run)
            except StopIteration as end:
                finished[i].append(end.value)
                live[i] = starts[i]()
    return finished
