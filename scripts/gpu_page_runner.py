"""Run one page as ``__main__`` for the GPU check (``scripts/gpu_check.py``):
``python scripts/gpu_page_runner.py PAGE.py``, in the page's output folder.

matplotlib's ``show()`` saves each open figure into the current folder,
numbered in order (``figure_N.png``), instead of drawing it. At its end, also
when stopped with SIGTERM, the page's peak memory goes to ``peak.json``. The
CUDA peak survives the pages' own ``reset_peak_memory_stats`` (``measure()``
resets it before each profile).
"""

import json
import resource
import runpy
import signal
import sys

import matplotlib

matplotlib.use("agg")
import matplotlib.pyplot as plt  # noqa: E402

shown = 0
cuda_peak = 0


def show(*args, **kwargs):
    global shown
    for number in plt.get_fignums():
        shown += 1
        plt.figure(number).savefig(f"figure_{shown}.png", dpi=100)
    plt.close("all")


def note_cuda_peak():
    global cuda_peak
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        cuda_peak = max(cuda_peak, torch.cuda.max_memory_allocated())


def stop(signum, frame):
    raise SystemExit(f"stopped by signal {signum}")


plt.show = show
try:
    import torch

    _reset = torch.cuda.reset_peak_memory_stats

    def reset_peak_memory_stats(device=None):
        note_cuda_peak()
        _reset(device)

    torch.cuda.reset_peak_memory_stats = torch.cuda.memory.reset_peak_memory_stats = reset_peak_memory_stats
except ImportError:
    torch = None
signal.signal(signal.SIGTERM, stop)
sys.argv = sys.argv[1:]
sys.path[0] = ""  # the current folder (the page's output), not scripts/
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    note_cuda_peak()
    cuda = torch is not None and torch.cuda.is_initialized()
    with open("peak.json", "w") as f:
        json.dump({"cuda_mib": round(cuda_peak / 2**20, 1) if cuda else None,
                   "rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}, f)
