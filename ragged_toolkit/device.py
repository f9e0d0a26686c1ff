"""The device and dtype to compute in where the caller chose none."""

from __future__ import annotations

import os

import torch

__all__ = []


def default_device():
    """``"cuda"`` where a GPU is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device):
    """The dtype a page computes in: ``bfloat16`` on CUDA (``float16`` on a GPU
    without it), ``float32`` on CPU. ``TUTORIALS_DTYPE`` overrides it, so the
    low-precision paths can be exercised on a CPU too."""
    name = os.environ.get("TUTORIALS_DTYPE")
    if name:
        if name not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"TUTORIALS_DTYPE must be float32, bfloat16 or float16, got {name!r}")
        return getattr(torch, name)
    if torch.device(device).type != "cuda":
        return torch.float32
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    print("This GPU has no bfloat16: the page runs in float16 instead.")
    return torch.float16
