"""The simulated server: a scheduler and the engine stepping over a stream
of requests, on a clock that advances by each step's measured time, each
request checked as it arrives (``check_request``); several
servers taking turns step by step, so that a busy machine weighs on them
alike."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..clock import stopwatch
from .engine import forward_step
from .requests import check_request
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
    """What a run of :func:`serve` did: the requests it served, its steps,
    and the requests it refused on arrival, each with its error."""

    requests: list
    steps: list
    refused: list = field(default_factory=list)  # (request, ValueError)


def _record_step(seconds, fed, slots, running, waiting, cache, now):
    """The ``StepRecord`` of a step that fed ``fed``, a list of
    ``(request, n, whether that was a decode token)``, in ``slots`` slots."""
    decode = sum(n for _, n, was_decode in fed if was_decode)
    arrived = sum(r.arrival <= now for r in waiting)
    return StepRecord(
        seconds,
        sum(n for _, n, _ in fed) - decode,
        decode,
        slots,
        arrived,
        sum(r.computed for r in running),
        sum(map(len, cache.tables.values())),
    )


def _stamp_clock(requests, now):
    """Note the clock on each request's first token and on its last."""
    for req in requests:
        if req.generated and req.first_token_s is None:
            req.first_token_s = now
        if req.done() and req.finish_s is None:
            req.finish_s = now


def serve(
    model,
    requests,
    cache,
    plan,
    retire_step=retire_finished,
    *,
    path="gathered",
    backend=None,
    flex=None,
    check=False,
    observe=None,
    on_refused=None,
    on_token=None,
):
    """Serve ``requests`` on a simulated clock that advances by each step's
    measured time and jumps to the next arrival when nothing runs. A generator
    yielding after each step (:func:`take_turns`), returning a
    ``ServingRun``. ``plan(running, waiting, cache, now)`` picks a step's
    work, ``retire_step(running, cache)`` ends it; ``path``, ``backend``
    and ``flex`` (a :class:`~ragged_toolkit.attention.flex.FlexKernel`, for
    FlexAttention) say how attention reads the cache
    (``build_step``); ``check``: verify the
    blocks after each step; ``observe(step, running, cache)``: called after each;
    ``on_token(request, logits)``: called with each token's logits
    (``forward_step``).

    A request the server cannot serve (``check_request``) is
    refused by name: without ``on_refused``, every request is checked before
    the first step and the first refused raises its ``ValueError``; with
    ``on_refused(request, error)``, each is checked when it arrives, and a
    refused one is left out (``ServingRun.refused``) while the requests
    running go on."""
    waiting = deque(sorted(requests, key=lambda r: r.arrival))
    arrivals, checked, refused = list(waiting), 0, []  # checked: arrivals[:checked] were checked
    if on_refused is None:
        for req in arrivals:
            check_request(req, model.cfg, cache)
        checked = len(arrivals)
    running, steps, now = [], [], 0.0
    while waiting or running:
        if not running and waiting[0].arrival > now:
            now = waiting[0].arrival
        while checked < len(arrivals) and arrivals[checked].arrival <= now:
            req, checked = arrivals[checked], checked + 1
            try:
                check_request(req, model.cfg, cache)
            except ValueError as error:
                waiting.remove(req)
                refused.append((req, error))
                on_refused(req, error)
        if not (waiting or running) or (not running and waiting[0].arrival > now):
            continue  # a refusal emptied the queue of what has arrived
        with stopwatch() as watch:
            work = plan(running, waiting, cache, now)
            fed = [(req, n, bool(req.generated) and req.pending() == 1) for req, n in work]
            slots = len(running)
            forward_step(model, cache, work, path, backend, on_token, flex=flex)
            retire_step(running, cache)
        now += watch.seconds
        _stamp_clock([req for req, _ in work], now)
        steps.append(_record_step(watch.seconds, fed, slots, running, waiting, cache, now))
        if check:
            cache.check()
        if observe is not None:
            observe(len(steps) - 1, running, cache)
        yield
    gone = {id(req) for req, _ in refused}
    return ServingRun([r for r in requests if id(r) not in gone], steps, refused)


def take_turns(*starts, runs=1):
    """Runs of :func:`serve` one step each in turn. ``starts`` are functions
    that start a run (a fresh :func:`serve` generator); a run that ends
    starts again until each has ended ``runs`` times, so that all span the
    same stretch of time and whatever else the machine does weighs on them
    alike. Returns, for each, its finished ``ServingRun`` s (at least
    ``runs``; a repeat still running at the end is dropped)."""
    finished, live = [[] for _ in starts], [start() for start in starts]
    while any(len(done) < runs for done in finished):
        for i, run in enumerate(live):
            try:
                next(run)
            except StopIteration as end:
                finished[i].append(end.value)
                live[i] = starts[i]()
    return finished
