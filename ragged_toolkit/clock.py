"""The one clock: a block timed with the device synchronized before the clock
starts and before it stops. The server advances its clock by it; the site's
measuring times every step with it too."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = []


def synchronize():
    """Wait for the GPU, where there is one, before a clock is read."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class _Stopwatch:
    """The seconds a ``with stopwatch()`` block took, once it has ended."""

    seconds: float = float("nan")


@contextmanager
def stopwatch():
    """Time one block, the device synchronized before the clock starts and
    before it stops: ``with stopwatch() as watch: ...``, then
    ``watch.seconds``. The one clock of the toolkit: every step a page or a
    server times goes through it."""
    watch = _Stopwatch()
    synchronize()
    start = time.perf_counter()
    try:
        yield watch
    finally:
        synchronize()
        watch.seconds = time.perf_counter() - start
