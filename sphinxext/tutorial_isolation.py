"""Nothing one tutorial changes may reach the next one.

``conf.py`` names :func:`reset_state` in Sphinx-Gallery's ``reset_modules``
(order "both"): before each tutorial it restores the process-wide state
recorded before the first one, seeds every random source, records the page's
environment stamp and starts its time limit; after it, it stops the limit and
restores the state again. Everything is restored through public APIs:

* seeds: torch, numpy's global generator, ``random``;
* torch: default dtype and device, grad mode, threads, float32 matmul
  precision and every ``fp32_precision`` setting, deterministic algorithms,
  anomaly detection, print options, the SDPA backend switches and reduced
  precision reductions, cuDNN flags, dynamo and inductor config and caches,
  ``torch._logging`` settings;
* numpy print options; warning filters; every logger's level, handlers,
  filters and propagation; ``os.environ``; matplotlib (Sphinx-Gallery's own
  "matplotlib" reset, and ``rcdefaults`` here).

:func:`use_private_compile_cache` (called from ``conf.py``) gives each build
its own inductor and Triton cache, so the compile times a page prints are
those of a cold cache whatever ran on the machine before.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path

import page_stamp
import tutorial_guards
import tutorial_memory
from gallery_layout import GALLERY_SRC, TOOLKIT

COMPILE_CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")

_baseline: dict = {}

# Settings with a getter and a setter of the same name: the fp32_precision
# tree (parents first: setting a parent resets its children).
_FP32_PRECISION = [
    "backends", "backends.cuda.matmul", "backends.cudnn", "backends.cudnn.conv",
    "backends.cudnn.rnn", "backends.mkldnn", "backends.mkldnn.matmul",
    "backends.mkldnn.conv", "backends.mkldnn.rnn",
]
_FLAGS = [  # (object path under torch, attribute)
    ("backends.cudnn", "benchmark"), ("backends.cudnn", "deterministic"),
    ("backends.cudnn", "enabled"),
    ("backends.cuda.matmul", "allow_fp16_reduced_precision_reduction"),
    ("backends.cuda.matmul", "allow_bf16_reduced_precision_reduction"),
]
_SDP = ["flash", "mem_efficient", "math", "cudnn"]


def use_private_compile_cache() -> dict[str, str]:
    """Point the inductor and Triton caches at a new folder for this build
    (removed when it ends), unless the caller chose one. Returns the
    settings in force, for the page stamp."""
    if not any(os.environ.get(v) for v in COMPILE_CACHE_VARS):
        root = Path(tempfile.mkdtemp(prefix="tutorials-compile-cache-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
        os.environ["TUTORIALS_COMPILE_CACHE"] = "private"
    else:
        os.environ.setdefault("TUTORIALS_COMPILE_CACHE", "chosen")
    return {v: os.environ.get(v, "") for v in COMPILE_CACHE_VARS}


def _obj(torch, path: str):
    obj = torch
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _loggers() -> dict[str, logging.Logger]:
    found = {name: lg for name, lg in logging.root.manager.loggerDict.items()
             if isinstance(lg, logging.Logger)}
    found[""] = logging.getLogger()
    return found


def _snapshot_baseline() -> None:
    """The process-wide state as it was before the first tutorial."""
    if _baseline:
        return
    import numpy as np
    import torch

    b = _baseline
    b["environ"] = dict(os.environ)
    b["warning_filters"] = list(warnings.filters)
    b["loggers"] = {name: (lg.level, list(lg.handlers), list(lg.filters), lg.propagate, lg.disabled)
                    for name, lg in _loggers().items()}
    b["numpy_print"] = np.get_printoptions()
    b["dynamo_config"] = torch._dynamo.config.save_config()
    b["inductor_config"] = torch._inductor.config.save_config()
    b["num_threads"] = torch.get_num_threads()
    b["matmul_precision"] = torch.get_float32_matmul_precision()
    b["fp32_precision"] = {p: _obj(torch, p).fp32_precision for p in _FP32_PRECISION
                           if hasattr(_obj(torch, p), "fp32_precision")}
    b["flags"] = {(p, a): getattr(_obj(torch, p), a) for p, a in _FLAGS if hasattr(_obj(torch, p), a)}
    cuda = torch.backends.cuda
    b["sdp"] = {name: getattr(cuda, f"{name}_sdp_enabled")() for name in _SDP
                if hasattr(cuda, f"{name}_sdp_enabled")}
    if hasattr(cuda, "fp16_bf16_reduction_math_sdp_allowed"):
        b["sdp_reduction"] = cuda.fp16_bf16_reduction_math_sdp_allowed()
    b["deterministic"] = (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled())


def _restore_environ() -> None:
    saved = _baseline["environ"]
    for key in list(os.environ):
        if key not in saved:
            del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _restore_logging() -> None:
    import torch._logging

    torch._logging.set_logs()  # torch's own log settings back to their defaults
    saved = _baseline["loggers"]
    for name, lg in _loggers().items():
        level, handlers, filters, propagate, disabled = saved.get(name, (logging.NOTSET, [], [], True, False))
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.filters[:] = filters
        lg.propagate = propagate
        lg.disabled = disabled
    logging.disable(logging.NOTSET)


def _restore_torch() -> None:
    import torch

    b = _baseline
    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    torch.set_grad_enabled(True)
    torch.autograd.set_detect_anomaly(False)
    torch.set_num_threads(b["num_threads"])
    torch.use_deterministic_algorithms(b["deterministic"][0], warn_only=b["deterministic"][1])
    torch.set_printoptions(profile="default", sci_mode=None)
    with warnings.catch_warnings():
        # Mixing the legacy precision API and fp32_precision may warn.
        warnings.simplefilter("ignore")
        torch.set_float32_matmul_precision(b["matmul_precision"])
        for path, value in b["fp32_precision"].items():
            _obj(torch, path).fp32_precision = value
        for (path, attr), value in b["flags"].items():
            setattr(_obj(torch, path), attr, value)
    cuda = torch.backends.cuda
    for name, enabled in b["sdp"].items():
        getattr(cuda, f"enable_{name}_sdp")(enabled)
    if "sdp_reduction" in b:
        cuda.allow_fp16_bf16_reduction_math_sdp(b["sdp_reduction"])
    torch._dynamo.reset()
    with warnings.catch_warnings():
        # Loading a saved config also sets its deprecated keys, which warns.
        warnings.simplefilter("ignore", FutureWarning)
        torch._dynamo.config.load_config(b["dynamo_config"])
        torch._inductor.config.load_config(b["inductor_config"])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _restore_state() -> None:
    import sys

    import numpy as np

    # Each page imports the toolkit module afresh: its caches (compiled
    # FlexAttention, batch plans) start empty on every page.
    sys.modules.pop(TOOLKIT.removesuffix(".py"), None)
    _restore_environ()
    _restore_torch()
    np.set_printoptions(**_baseline["numpy_print"])
    warnings.filters[:] = _baseline["warning_filters"]
    warnings._filters_mutated()  # noqa: SLF001 - invalidate the per-module caches
    _restore_logging()

    import torch

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)

    import matplotlib
    import matplotlib.pyplot as plt

    plt.close("all")
    matplotlib.rcdefaults()
    matplotlib.use("agg")


def reset_state(gallery_conf, fname, when):
    """Sphinx-Gallery ``reset_modules`` callable (order "both")."""
    _snapshot_baseline()
    if when == "before":
        _restore_state()
        if fname is not None:
            page_stamp.record_environment(gallery_conf["src_dir"], fname)
            tutorial_memory.release_freed_memory()
            tutorial_guards.start_tutorial(f"{GALLERY_SRC}/{fname}")
    else:
        tutorial_guards.end_tutorial()
        _restore_state()
