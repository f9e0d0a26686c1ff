"""Figures as data. Every figure a page prints (a timing, a speedup beside
its work bound, a throughput, a latency, a difference against its
tolerance) is also written as a record: one JSON object per line, with the
``kind`` of figure, the ``line`` the page printed, and its numbers. The
records go to the file that ``$RAGGED_SITE_FIGURES`` names; the site build
sets it beside each page's output, and ``scripts/gpu_check.py`` in each
page's folder, so that both read numbers, not printed text. With it unset,
nothing is written.

The printing helpers of :mod:`ragged_site.measuring` record what they
return; a page records a line it writes itself with :func:`record`."""

from __future__ import annotations

import json
import math
import os

__all__ = ["FIGURES_ENV", "record", "read_records"]

FIGURES_ENV = "RAGGED_SITE_FIGURES"


def _plain(value):
    """``value`` as JSON holds it: a tensor or numpy scalar as a number, NaN
    and infinities as ``None`` (not measured), tuples as lists."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item"):  # a tensor or numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (int, float)):
        return value
    return str(value)


def record(kind, line, **figures):
    """Record the figure that ``line`` prints: its ``kind`` (``"timing"``,
    ``"speedup"``, ``"throughput"``, ``"fraction"``, ``"serving"``,
    ``"difference"``, ...), the line itself, and its numbers as keywords.
    Returns ``line``, for the caller to print."""
    path = os.environ.get(FIGURES_ENV)
    if path:
        entry = {"kind": kind, "line": line.strip("\n")}
        entry.update({name: _plain(value) for name, value in figures.items()})
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, sort_keys=False) + "\n")
    return line


def read_records(path):
    """The records of one page's run, in the order it printed them (an empty
    list where the file does not exist: the page recorded nothing). A last
    line without its newline is a record cut off when the page was stopped:
    it is left out, and every complete one kept."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines[:-1] if line.strip()]
