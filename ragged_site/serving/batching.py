"""The continuous-batching page's machinery: one serving step on every
paged attention path, timed and proved against decoding alone
(:func:`time_and_prove_paths`); and the paged cache watched after every
step of a run, for its picture (:class:`CacheSnapshots`)."""

from __future__ import annotations

import functools

import torch

from ragged_site.measuring.compiling import compile_counter
from ragged_site.measuring.tables import print_timings
from ragged_site.measuring.timing import measure
from ragged_site.serving.proof import logits_after

__all__ = ["time_and_prove_paths", "CacheSnapshots"]

_KNOWN_BUGS = {"varlen": " (a known bug of paged split-KV: pytorch/pytorch#194167)"}


def time_and_prove_paths(logits_of, paths, reference, work, tolerance, *, run_time, profile):
    """Time one serving step on each attention path, then prove it.
    ``logits_of(path)`` runs the step on a path (``step_logits``, its
    model, cache and work given); ``paths`` maps a path to ``None``, or to
    why it cannot run.
    The paths that run are timed side by side, the first call (compiling)
    apart (:func:`~ragged_site.measuring.timing.measure`, ``run_time``
    seconds, ``profile``), and printed: a table, the first calls and what
    ``torch.compile`` did. Then each path's logits must equal, within
    ``tolerance`` (``assert_close`` keywords), those of decoding each request
    of ``work`` alone with ``reference`` (a float32 model) over its history
    once the step has run, and the gathered path's. Raises
    ``AssertionError`` naming the path; returns path -> ``Timing``."""
    expected = torch.stack(
        [
            logits_after(reference, (req.prompt + req.generated)[: req.computed + n])
            for req, n in work
        ]
    )  # each request's history once this step has run
    runnable = {p: functools.partial(logits_of, p) for p, why in paths.items() if not why}
    with compile_counter() as compiled:
        timings = measure(runnable, min_run_time=run_time, profile=profile)
    print_timings({p: timings.get(p, why) for p, why in paths.items()})
    print(
        "first calls: "
        + ", ".join(f"{p} {timings[p].first_call_s:.2f} s" for p in runnable)
        + f"; torch.compile: {compiled}"
    )
    for path, run in runnable.items():
        note = _KNOWN_BUGS.get(path, "")
        for want, what in (
            (expected, "decoding alone"),
            (runnable["gathered"]().float(), "gathered"),
        ):
            torch.testing.assert_close(
                run().float(),
                want,
                **tolerance,
                msg=lambda m: f"{path}{note}: step logits differ from {what}: {m}",
            )
    return timings


class CacheSnapshots:
    """An observer of a serving run (``serve(..., observe=)``) that keeps,
    after each step, the paged cache's block tables, its free list and each
    running request's keys in use: ``shots``, a list of dicts with
    ``tables``, ``free`` and ``keys`` (request id -> keys), as
    :func:`~ragged_site.figures.draw_paged_cache` takes them."""

    def __init__(self):
        self.shots = []

    def __call__(self, step, running, cache):
        self.shots.append(
            dict(
                tables=dict(cache.tables),
                free=list(cache.free),
                keys={r.rid: r.computed for r in running},
            )
        )

    def fullest(self):
        """The shot with the most requests among those with a block free (so
        that a free block shows), else among all."""
        return max(
            [s for s in self.shots if s["free"]] or self.shots, key=lambda s: len(s["tables"])
        )
