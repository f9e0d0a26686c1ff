"""The memory figure under each tutorial page ("Estimated memory usage").

Sphinx-Gallery calls the ``show_memory`` callable around every code block and
around an empty call just before the tutorial starts, and prints the largest
block figure minus that starting one.

* With CUDA: ``torch.cuda.max_memory_allocated``, peak since reset.
* On CPU, where PyTorch keeps no allocator statistics: the resident memory
  (RSS) of the build process from ``psutil`` (Linux, macOS, Windows), sampled
  every 5 ms while the block runs. Memory a previous page freed but the C
  allocator kept would be reused without raising the RSS, so the figure would
  depend on which page ran before: before each page the build returns freed
  heap memory to the system (``malloc_trim`` where the C library has it, see
  :func:`release_freed_memory`). Where neither psutil nor that works, the
  figure is the growth of the process's peak RSS, a lower bound, and the page
  stamp says so.

Each block runs inside :func:`tutorial_guards.run_block` (time limit, no
``sys.exit``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
import threading

import tutorial_guards

SAMPLE_S = 0.005


_PROCESS = {}  # pid -> psutil.Process, made once: it is read every SAMPLE_S


def _psutil_rss() -> int:
    import os

    import psutil

    pid = os.getpid()
    if pid not in _PROCESS:
        _PROCESS[pid] = psutil.Process(pid)
    return _PROCESS[pid].memory_info().rss


def _peak_rss() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def rss_source():
    """(function returning bytes, whether it reads the current RSS) for this
    machine."""
    try:
        _psutil_rss()
        return _psutil_rss, True
    except Exception:  # psutil missing, or no /proc on a Linux without it
        return _peak_rss, False


def independent_of_page_order() -> bool:
    """Whether the CPU figure is the page's own: the current RSS can be read,
    and memory freed by earlier pages can be handed back first."""
    return rss_source()[1] and _malloc_trim() is not None


_LIBC = []  # [the C library, or None], once looked up


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    if not _LIBC:
        name = ctypes.util.find_library("c")
        try:
            _LIBC.append(ctypes.CDLL(name) if name else None)
        except OSError:
            _LIBC.append(None)
    return getattr(_LIBC[0], "malloc_trim", None)


def release_freed_memory() -> bool:
    """Hand memory that is free in the C allocator back to the system, so
    the next page's allocations raise the RSS. True where that is possible."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class PeakMemory:
    """Sphinx-Gallery ``show_memory`` callable: returns (MB, func's result).

    An instance rather than a function so that Sphinx can pickle the
    configuration holding it.
    """

    def __repr__(self):
        return "tutorial_memory.PeakMemory()"

    def __call__(self, func):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = tutorial_guards.run_block(func)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 2**20, out
        return _cpu_peak(func)


def _cpu_peak(func):
    rss, _ = rss_source()
    peak = [rss()]
    done = threading.Event()

    def sample():
        while not done.wait(SAMPLE_S):
            peak[0] = max(peak[0], rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = tutorial_guards.run_block(func)
    finally:
        done.set()
        sampler.join()
    peak[0] = max(peak[0], rss())
    return peak[0] / 2**20, out
