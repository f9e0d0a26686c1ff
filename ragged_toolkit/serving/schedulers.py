"""Two schedulers on one engine: static batches, and continuous batching
with chunked prefill and preemption. A scheduler picks a step's work, a
list of ``(request, n)``: feed ``request`` its next ``n`` tokens."""

from __future__ import annotations

__all__ = ["plan_continuous", "plan_static", "retire_batch"]


def _preempt(req, cache):
    """Free a request's blocks: when admitted again, it recomputes its keys
    from position 0 of ``prompt + generated``."""
    cache.release(req.rid)
    req.computed = 0
    req.preempted += 1


def plan_continuous(running, waiting, cache, now, *, max_running, token_budget):
    """Continuous batching: one step's work, a list of ``(request, n)``.
    Running requests first, in admission order (a decode token each, or
    their next prompt chunk); when no block is free, the most recently
    admitted is preempted to the front of ``waiting``. Then, if none was,
    requests that have arrived by ``now`` join while slots, free blocks and
    the step's token budget allow, a long prompt cut into chunks; a
    newcomer first takes the longest prefix the cache holds
    (``cache.take_prefix``, nothing for a plain paged cache)."""
    work, budget, i, preempted = [], token_budget, 0, False
    while i < len(running) and budget > 0:
        req = running[i]
        n = min(req.pending(), budget)
        if cache.reserve(req.rid, req.computed + n):
            work.append((req, n))
            budget, i = budget - n, i + 1
            continue
        if len(running) == 1:
            raise RuntimeError(f"request {req.rid} alone needs more than the cache's blocks")
        victim = running.pop()  # the most recently admitted
        _preempt(victim, cache)
        waiting.appendleft(victim)
        preempted = True
    while (
        not preempted
        and waiting
        and waiting[0].arrival <= now
        and len(running) < max_running
        and budget > 0
    ):
        req = waiting[0]
        if req.computed == 0:  # the keys of a cached prefix are not computed again
            req.computed = cache.take_prefix(req.rid, req.prompt + req.generated)
        n = min(req.pending(), budget)
        if not cache.reserve(req.rid, req.computed + n):
            cache.release(req.rid)  # and the prefix it took
            req.computed = 0
            if not running:
                raise RuntimeError(f"request {req.rid} alone needs more than the cache's blocks")
            break
        running.append(waiting.popleft())
        work.append((req, n))
        budget -= n
    return work


def plan_static(running, waiting, cache, now, *, batch_size, reserve, skip_finished=False):
    """Static batching: with no batch running, up to ``batch_size`` requests
    that have arrived by ``now`` start together, their whole prompts in one
    packed step, ``len(prompt) + reserve`` rows each reserved up front. Then
    each gets one token per step and none joins until all are done; a
    finished request's slot idles, computing a padding token as a batched
    ``generate`` (or a fixed-shape step) does, or nothing (``skip_finished``)."""
    if not running:
        while waiting and waiting[0].arrival <= now and len(running) < batch_size:
            req = waiting.popleft()
            if not cache.reserve(req.rid, len(req.prompt) + reserve):
                raise RuntimeError(f"the cache has no room for a static batch of {batch_size}")
            running.append(req)
    return [
        (req, 0 if req.done() else req.pending())
        for req in running
        if not (skip_finished and req.done())
    ]


def retire_finished(running, cache):
    """Continuous batching: finished requests leave, their blocks freed."""
    for req in [r for r in running if r.done()]:
        cache.release(req.rid)
        running.remove(req)


def retire_batch(running, cache):
    """Static batching: the batch leaves when its last request is done."""
    return all(r.done() for r in running) and retire_finished(running, cache)
