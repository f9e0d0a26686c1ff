"""Measured figures as the pages print them."""

from __future__ import annotations

from .timing import Timing

__all__ = ["print_timings"]


def print_timings(results):
    """One line per entry of ``results`` (name -> ``Timing``, or the reason it
    did not run), names aligned."""
    width = max(map(len, results), default=0)
    for name, r in results.items():
        print(f"  {name:{width}s} {r}" if isinstance(r, Timing) else f"  {name:{width}s} not available: {r}")
