"""What ``torch.compile`` did: the graphs it compiled, the graph breaks it
met, and the warnings that say a compiled function ran uncompiled."""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["compile_totals", "CompileCount", "compile_counter"]


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
        shapes = (
            f" for {len(self.shapes)} batch shape{'s' * (len(self.shapes) != 1)}"
            if self.shapes
            else ""
        )
        return (
            f"{self.graphs} graph{'s' * (self.graphs != 1)} compiled{shapes}, "
            f"{self.breaks} graph break{'s' * (self.breaks != 1)}{fell}"
        )


_FALLBACK_NOTES = ("called without torch.compile", "recompile_limit", "cache_size_limit")


class _FallbackLog(logging.Handler):
    def __init__(self, count):
        super().__init__(logging.WARNING)
        self.count = count

    def emit(self, record):
        if any(n in record.getMessage() for n in _FALLBACK_NOTES):
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
        if any(n in text for n in _FALLBACK_NOTES):
            count.fallbacks.append(text.splitlines()[0][:200])
        elif (text, w.category) not in shown:
            shown.add((text, w.category))
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
