"""Run every tutorial as a plain script on a CUDA GPU, and summarize.

For a bare GPU machine with only PyTorch, numpy and matplotlib (no Sphinx,
no network): each page in ``tutorials/`` runs at its CUDA sizes, in reading
order, in its own folder under ``--out`` (its printed output is kept there as
``output.txt``, and each figure it shows as ``figure_N.png``). One line per page says whether it
passed, how long it took, and the fractions of the work bound it printed;
the exit status is 1 if any page failed, 2 if there is no CUDA GPU.

    python scripts/gpu_check.py                  # every page
    python scripts/gpu_check.py --pages gpt      # pages whose name matches

``--allow-cpu`` runs the same on a machine without CUDA (for testing this
script; the pages then pick their CPU sizes).

A page that imports a package this Python lacks beyond PyTorch, numpy and
matplotlib (``transformers`` for ``hf_packed_training``) is not run: its line
says SKIP, names the package and how to bring it in, and the total counts
it; a skip fails nothing.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sphinxext"))
from gallery_layout import reading_order_key, tutorial_sources  # noqa: E402  (standard library only)

BUDGET_S = 8 * 60  # the whole check, on one H200
FRACTION = re.compile(r"fraction(?: of bound)? (\d+\.\d+)")
TRAINING = re.compile(r"^(?:\w+ )?training: ragged .*$", re.M)  # "hf training: ragged ..." too
# the data-parallel page: one line per wrapper and launch (gloo on the CPU, NCCL per GPU)
DATA_PARALLEL = re.compile(r"^data-parallel step: world size (\d+), gradient max difference "
                           r"to one process (\S+)$", re.M)


def cuda_status() -> tuple[bool, str]:
    """Whether this Python's PyTorch sees a CUDA GPU, and a line that says so."""
    probe = ("import torch; ok = torch.cuda.is_available(); "
             "print(ok, torch.__version__, torch.version.cuda, torch.cuda.get_device_name() if ok else '')")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return False, (f"gpu-check needs PyTorch with CUDA, and PyTorch does not import in {sys.executable} "
                       f"({last}); run it with the Python that has it: make gpu-check PYTHON=...")
    ok, version, cuda, *name = proc.stdout.split(maxsplit=3)
    if ok != "True":
        build = "a CPU-only build" if cuda == "None" else f"a CUDA {cuda} build"
        return False, (f"no CUDA GPU is visible (torch.cuda.is_available() is False; PyTorch {version}, "
                       f"{build}): gpu-check needs a machine with an NVIDIA GPU and a CUDA build of PyTorch")
    return True, f"PyTorch {version}, CUDA {cuda}, {' '.join(name).strip()}"


# Packages some pages import beyond the bare GPU machine's torch, numpy and
# matplotlib, and the line that says how to bring them (they are pinned in
# requirements-tutorials.txt).
OPTIONAL = {"transformers": "pip install --no-index --find-links wheels transformers "
                            "(wheels from pip download -d wheels transformers==<pin>)"}


def missing_packages(path: Path) -> list[str]:
    """The packages of ``OPTIONAL`` that the page imports and this Python lacks."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    return sorted(name for name in imported & set(OPTIONAL) if importlib.util.find_spec(name) is None)


def summarize(stem: str, ok: bool, seconds: float, output: str) -> str:
    """The one-line summary of a page: status, time, the fractions it printed."""
    fractions = FRACTION.findall(output)
    line = f"{'PASS' if ok else 'FAIL'} {stem:40s} {seconds:7.1f} s"
    if fractions:
        line += "  fractions of bound: " + ", ".join(fractions)
    training = TRAINING.search(output)
    if training:
        line += f"  | {training.group(0)}"
    steps = DATA_PARALLEL.findall(output)
    if steps:
        line += "  | data-parallel gradients: " + ", ".join(f"world size {w} {d}" for w, d in steps)
    if not ok:
        last = [ln for ln in output.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        line += f"  | {last[0][:160]}"
    return line


# Runs a page as __main__ with matplotlib's show() saving each open figure
# into the current folder, numbered in order, instead of drawing it.
RUNNER = """\
import runpy, sys
import matplotlib
matplotlib.use("agg")
import matplotlib.pyplot as plt
shown = 0
def show(*args, **kwargs):
    global shown
    for number in plt.get_fignums():
        shown += 1
        plt.figure(number).savefig(f"figure_{shown}.png", dpi=100)
    plt.close("all")
plt.show = show
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_page(path: Path, out: Path, timeout: float, env: dict) -> tuple[bool, float, str]:
    folder = out / path.stem
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(path)], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=timeout)
        ok, output = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        ok = False
        output = ((err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
                  + f"\nstopped after {timeout:.0f} s (the page's time limit)")
    seconds = time.perf_counter() - start
    (folder / "output.txt").write_text(output, encoding="utf-8")
    return ok, seconds, output


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-check", help="folder for the pages' outputs")
    ap.add_argument("--pages", default="", help="run only pages whose file name matches this regex")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one page may take")
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA (to test this script)")
    args = ap.parse_args(argv)

    ok, status = cuda_status()
    if not ok and not args.allow_cpu:
        print(f"error: {status}", file=sys.stderr)
        return 2
    print(f"gpu-check: {status}")
    pages = sorted((p for p in tutorial_sources(ROOT) if re.search(args.pages, p.name)),
                   key=lambda p: reading_order_key(p.stem))
    if not pages:
        print(f"error: no tutorial matches {args.pages!r}", file=sys.stderr)
        return 1
    # the pages import the toolkit module that lies beside them
    env = {**os.environ, "MPLBACKEND": "agg", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    results, total = [], time.perf_counter()
    for path in pages:
        missing = missing_packages(path)
        if missing:
            line = (f"SKIP {path.stem:40s} needs {', '.join(missing)}, not installed here: "
                    + "; ".join(OPTIONAL[m] for m in missing))
            print(line, flush=True)
            results.append({"page": path.stem, "passed": None, "skipped": f"needs {', '.join(missing)}",
                            "seconds": 0.0, "fractions": [], "summary": line})
            continue
        passed, seconds, output = run_page(path, args.out, args.timeout, env)
        line = summarize(path.stem, passed, seconds, output)
        print(line, flush=True)
        results.append({"page": path.stem, "passed": passed, "seconds": round(seconds, 1),
                        "fractions": [float(f) for f in FRACTION.findall(output)], "summary": line})
    elapsed = time.perf_counter() - total
    skipped = sum(r["passed"] is None for r in results)
    print(f"gpu-check: {sum(bool(r['passed']) for r in results)} of {len(results)} pages passed in {elapsed:.0f} s"
          + (f", {skipped} skipped (a package missing)" if skipped else "")
          + ("" if elapsed <= BUDGET_S else f" (over the {BUDGET_S // 60}-minute budget)"))
    (args.out / "summary.json").write_text(json.dumps({"status": status, "seconds": round(elapsed, 1),
                                                       "pages": results}, indent=1) + "\n")
    return 0 if all(r["passed"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
