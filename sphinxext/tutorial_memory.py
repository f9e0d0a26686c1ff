"""The callable Sphinx-Gallery runs every code block through (``show_memory``).

It gives the memory figure under each page ("Estimated memory usage"). Each
tutorial runs in a process of its own (``tutorial_isolation``), so the
figure is that process's own peak, kept by the system, nothing sampled:
with CUDA ``torch.cuda.max_memory_allocated``; on CPU the peak resident
memory (``VmHWM`` on Linux, ``ru_maxrss`` on macOS, the peak working set on
Windows), started afresh just before the page's first block, so that what
the process did before (a fresh interpreter's start-up, Sphinx-Gallery's
imports) cannot hide it; where the system cannot do that (macOS, Windows)
the page stamp calls the figure a lower bound. Sphinx-Gallery calls it
around an empty call before the first block too, and prints the largest
figure minus that first one.

It also keeps a page from ending the build: a ``SystemExit`` in a block
becomes :class:`TutorialFailure`, an ordinary exception naming the tutorial
and the line, so the page is written with the error where its code stopped
and the build fails once every page has run.
"""

from __future__ import annotations

import os
import sys
from pathlib import PurePath

CPU_FIGURE = ("peak resident memory (RSS) of the process that ran this page and nothing else, "
              "above what it held when the page's code began")
CUDA_FIGURE = ("peak CUDA memory allocated (torch.cuda.max_memory_allocated) by the process that "
               "ran this page and nothing else")
LOWER_BOUND = ", a lower bound (the process's start-up may have used more before the page began)"
CLEAR_REFS = "/proc/self/clear_refs"  # "5" starts the peak afresh (Linux)
_started: list[bool] = []  # once the page's empty first call has run, in this process
_current = {"file": None}  # "tutorials/<name>.py", set in the tutorial's process


class TutorialFailure(RuntimeError):
    """Raised to Sphinx-Gallery in place of the tutorial's SystemExit."""


def start_tutorial(name: str | None) -> None:
    _current["file"] = name


def cpu_figure() -> str:
    """What the CPU figure is, for the page stamp."""
    return CPU_FIGURE + ("" if os.access(CLEAR_REFS, os.W_OK) else LOWER_BOUND)


def reset_peak() -> bool:
    """Start this process's peak resident memory afresh, where the system
    allows it. Returns whether it could."""
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB: ``VmHWM`` on Linux (what
    the reset starts afresh; ``ru_maxrss`` there also keeps the peak of the
    build process a spawned interpreter was started from)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 2**10
    except (OSError, StopIteration):
        pass
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        return psutil.Process().memory_info().peak_wset / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB elsewhere


def run_block(func):
    """Run one code block of the current tutorial: no ``sys.exit``."""
    name = _current["file"]
    try:
        return func()
    except SystemExit as exc:
        if name is None:  # not inside a tutorial (a test)
            raise
        line, tb = None, exc.__traceback__  # the tutorial's innermost line
        while tb is not None:
            if PurePath(tb.tb_frame.f_code.co_filename).as_posix().endswith("/" + name):
                line = tb.tb_lineno
            tb = tb.tb_next
        raise TutorialFailure(
            f"{name} called sys.exit({exc.code!r}) (or raised SystemExit)"
            f"{'' if line is None else f' at line {line}'}: a tutorial must not end the build; "
            "raise an exception instead") from None


class PeakMemory:
    """Sphinx-Gallery ``show_memory`` callable: returns (MB, func's result).

    An instance rather than a function so that Sphinx can pickle the
    configuration holding it.
    """

    def __repr__(self):
        return "tutorial_memory.PeakMemory()"

    def __call__(self, func):
        import torch

        if not _started:  # Sphinx-Gallery's empty call before the first block
            _started.append(reset_peak())
        out = run_block(func)
        if torch.cuda.is_available():
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 2**20, out
        return peak_rss_mb(), out
