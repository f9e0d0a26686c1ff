"""What every page does first (:func:`page_setup`): the device and dtype it
computes in, the sizes it chooses for them, the test suite's quick mode, the
tolerances that go with the dtype, and PyTorch's notes that say nothing about
a page quieted. The site's machinery, not code to copy."""

from __future__ import annotations

import logging
import os
import types
import warnings

import torch

from ragged_toolkit.device import default_device, default_dtype

__all__ = ["tolerances", "quick_mode", "quiet_known_notes", "page_sizes", "page_setup"]


def tolerances(dtype):
    """``assert_close`` tolerances for results computed in ``dtype``."""
    return {
        torch.float32: dict(atol=1e-4, rtol=1e-4),
        torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
        torch.float16: dict(atol=5e-3, rtol=5e-3),
    }[dtype]


def quick_mode():
    """Whether ``TUTORIALS_QUICK=1`` asks for the small sizes of the test suite."""
    return os.environ.get("TUTORIALS_QUICK") == "1"


class _DropNotes(logging.Filter):
    def filter(self, record):
        return not record.getMessage().startswith(("is_fx_tracing", "Failed to pickle cache key"))


def quiet_known_notes():
    """Hide messages PyTorch prints that say nothing about a page's code: the
    prototype notice of nested tensors, inductor's note about caching nested
    graphs, a torch.fx note that building a block mask triggers, and the
    profiler's log lines."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    warnings.filterwarnings("ignore", message=r".*nested tensors is in prototype stage")
    warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")
    for name in ("torch.fx._symbolic_trace", "torch._inductor.codecache"):
        logging.getLogger(name).addFilter(_DropNotes())


def page_sizes(sizes, device, quick):
    """A page's sizes on ``device``: ``sizes["cuda"]`` or ``sizes["cpu"]``,
    updated by ``sizes["quick"]`` in quick mode (nested dicts merged key by
    key). The one place a page chooses its sizes, as a literal dict, so that
    the CUDA audit (``tests/test_cuda_audit.py``) reads a page's CUDA sizes
    without running it."""
    chosen = {
        k: dict(v) if isinstance(v, dict) else v
        for k, v in sizes["cuda" if device == "cuda" else "cpu"].items()
    }
    for key, value in (sizes.get("quick", {}) if quick else {}).items():
        chosen[key] = {**chosen[key], **value} if isinstance(value, dict) else value
    return chosen


def page_setup(sizes, *, threads=1, seed=0):
    """What every page does first: the device and dtype it computes in, quick
    mode, its sizes for them (:func:`page_sizes`), ``threads`` CPU threads per
    operator for the whole page (one, as every timing runs with:
    ``torch.compile`` guards on the thread count, so compiled code is
    compiled for the threads it is timed with), the seed, and PyTorch's
    notes that say nothing about the page quieted. Prints one line.
    Returns a namespace: ``device``, ``dtype``, ``quick``, ``seed`` and
    ``sizes`` (a namespace of the chosen sizes)."""
    device = default_device()
    dtype, quick = default_dtype(device), quick_mode()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    quiet_known_notes()
    chosen = page_sizes(sizes, device, quick)
    print(
        f"PyTorch {torch.__version__}, device: {device}, dtype: {dtype}"
        + (", quick mode" if quick else "")
    )
    return types.SimpleNamespace(
        device=device, dtype=dtype, quick=quick, seed=seed, sizes=types.SimpleNamespace(**chosen)
    )
