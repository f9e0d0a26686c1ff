"""The GPU check: every tutorial as a plain script on a CUDA GPU, planned to
record the most in one lease of a GPU machine; and the record of a run for
the site.

For a bare GPU machine with only PyTorch, numpy and matplotlib (no Sphinx,
no network, no ``make``)::

    python scripts/gpu_check.py --out gpu-check --dry-run   # its timeline only (runs anywhere)
    python scripts/gpu_check.py --out "${TMPDIR:-/tmp}/gpu-check" --bundle "$OUT" --commit SHA
    python scripts/gpu_check.py record FILES_AT/gpu-check.tgz   # back here: into gpu-results/

The second line is :data:`LEASE_COMMAND`, the first command on a lent GPU:
the run outside the repository's copy, and under ``$OUT`` only what the
device machine sends back (:data:`RETURN_LIMITS`): ``summary.json`` and
:data:`BUNDLE_ARCHIVE`, the run without its compile cache.

A run has three stages; each prints a line as each of its steps finishes and
rewrites ``summary.json``, so a run cut off from outside still leaves what
it found:

1. ``preflight`` (at most 45 s): the torch, CUDA, cuDNN and triton versions,
   the GPUs, ``varlen_attn``'s signature, the SDPA kernel a ``bfloat16``
   causal call picks, the cost of cuDNN attention's first call for each of
   a few shapes, then whether a tiny ``torch.compile`` and a tiny compiled
   ``flex_attention`` build.
2. ``full``: full size, first :data:`FULL_SIZE_FIRST` (the decision page),
   then every other page, shortest expected first; a page starts only when
   its expected time fits what is left of ``--limit``. A page that needs
   more GPUs than the machine has (:data:`NEEDS_GPUS`) is skipped, named.
3. ``quick``: ``TUTORIALS_QUICK=1`` for the pages that did not get a full-size
   run (only those), in the same order, each while its expected time fits.

A page's expected time (:class:`Expected`) is the duration a recorded
GPU run measured for it in that mode (``gpu-results/summary.json``, a run
that passed), else its CPU build's duration (``.github/tutorial-durations.json``)
times :data:`GPU_FACTOR` for the mode, and at least
:data:`CUDA_COMPILES_FACTOR` for the pages that compile more on CUDA: an assumption, stated by the dry run,
until a GPU run is recorded. ``--dry-run`` prints the timeline this gives:
the start and end second of every step, where each expected time comes
from, and every page that will not fit (and in which mode it runs instead).

Every step keeps within ``--limit`` (the whole run, in seconds): a page runs
at most until it is reached, and one still running then is stopped and
counted as cut, not failed. A page past its own limit (``--page-limit``) is
stopped with every process it started, and fails, named; what it printed is
kept. Every page compiles into one cache, ``compile-cache/`` under ``--out``.
Under ``--out``: ``summary.json``, ``preflight.txt``, and for each page and
mode ``PAGE/MODE/output.txt`` (its standard output and error),
``figures.jsonl`` (the figures it printed, as records: ``$RAGGED_SITE_FIGURES``
names it, :mod:`ragged_site.records` writes it), ``figure_N.png`` (each
figure it shows) and ``peak.json`` (the peak memory of its process). A
page's line and its entry in ``summary.json`` are made from its records,
not from its printed text: the fractions of the work bound, the training,
serving and data-parallel lines, and the lines the site shows (``key_lines``).

A page that imports a package this Python lacks beyond PyTorch, numpy and
matplotlib (``transformers`` for ``hf_packed_training``) is not run: its
line says SKIP, names the package and how to bring it in; a skip fails
nothing. Exit status: 1 if the preflight or a page failed, 2 if PyTorch sees
no CUDA GPU (``--allow-cpu`` runs all the same, to test this script: the
pages then pick their CPU sizes).

``record OUTDIR`` records a run for the site (``scripts/gpu_record.py``).
The preflight's probes are ``scripts/gpu_preflight.py``; each page runs
under ``scripts/gpu_page_runner.py``.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "sphinxext"), str(ROOT / "scripts")]
from gallery_layout import reading_order_key, tutorial_sources  # noqa: E402  (standard library only)

from ragged_site.records import FIGURES_ENV, read_records  # noqa: E402  (standard library only)

import gpu_record  # noqa: E402  (scripts/: the record of a run)
from gpu_record import BUNDLE_ARCHIVE, RECORD_FILE, RESULTS  # noqa: E402

# Full size (stage 2): these pages first, in this order (the decision page),
# then every other page, shortest expected first: the most pages at full size.
FULL_SIZE_FIRST = ["which_attention_path"]
DURATIONS = Path(".github") / "tutorial-durations.json"  # in the site's folder, written by scripts/shards.py

# What a page takes on the GPU machine, until a GPU run is recorded: its CPU
# build's duration (full size, 2 cores) times a factor per mode. Assumptions,
# stated by the dry run: quick mode at CPU-build time (the estimate of issue
# 35, 460-740 s for every page in quick mode, cold, against 439 s of CPU
# builds, was made with FlexAttention recompiling per shape and profiler
# sessions in quick mode, both gone: compiling dominates a quick run on the
# GPU as it does on the CPU); full size at twice that (the same compiles,
# plus timed runs of 0.5-1 s per comparison where the CPU pages time 0.2-0.3
# s, and the decision page's profiler sessions). Where a page has no CPU
# duration, the CPU budget of CONTRIBUTING.md (90 s) stands in for it.
GPU_FACTOR = {"full": 2.0, "quick": 1.0}
# Pages that compile more on CUDA than on the CPU, in either mode: their
# expected time is at least this times the CPU build's. The decision page
# adds FlexAttention's forward and backward compiles with dynamic shapes and
# about 45 profiler sessions; the building blocks FlexAttention's forward,
# the attention layer's page its backward;
# the recurrent page's compile is the identity on the CPU and two cold
# inductor compiles on CUDA.
CUDA_COMPILES_FACTOR = {"which_attention_path": 4.0, "transformer_building_blocks": 4.0,
                        "packed_attention_layer": 4.0, "packed_recurrent_layers": 4.0}
# Pages that need several GPUs to give a GPU figure: with fewer, the
# data-parallel page runs gloo ranks on the CPU at the CUDA sizes, a CPU
# figure, so the check skips it, named.
NEEDS_GPUS = {"data_parallel_packed_training": 2}
LENT_GPUS = 1  # what a lent machine has: the dry run's default where this one has no CUDA
UNKNOWN_CPU_S = 90.0
PREFLIGHT_EXPECTED_S = 30.0  # until a recorded run's preflight says how long it took

DEFAULT_LIMIT_S = 540.0  # the whole run: one command of a 15-minute lease, with the machine's start
PREFLIGHT_LIMIT_S = 45.0
PAGE_LIMIT_S = 300.0  # each page, in either mode
MIN_START_S = 10.0  # no page starts with less than this left of the overall limit
GRACE_S = 5.0  # after SIGTERM, before SIGKILL
STAGES = ("preflight", "full", "quick")
# What the device machine sends back: only what the command leaves under
# $OUT, at most 8 files, 16 MiB each, 64 MiB in all, at most 2 folders down
# ($OUT/a/b/file comes back, $OUT/a/b/c/file does not).
RETURN_LIMITS = {"files": 8, "file_bytes": 16 * 2**20, "total_bytes": 64 * 2**20, "depth": 2}
# The first command on a lent GPU, from the repository's root (the README
# quotes it; tests/test_gpu_check.py runs it): the run outside the repository
# copy, and under $OUT only its summary and one archive, both rewritten after
# every step. SHA: the commit the copy was made from (the copy has no .git).
LEASE_COMMAND = 'python scripts/gpu_check.py --out "${TMPDIR:-/tmp}/gpu-check" --bundle "$OUT" --commit SHA'
PREFLIGHT = ROOT / "scripts" / "gpu_preflight.py"  # the machine's versions, and the preflight's probes
PAGE_RUNNER = ROOT / "scripts" / "gpu_page_runner.py"  # one page as __main__: its figures and peak memory
FIGURES = "figures.jsonl"  # beside a page's output.txt: the figures it printed, as records (ragged_site/records.py)


# --- the machine ---------------------------------------------------------------------

def probe_environment() -> tuple[dict | None, str]:
    """The machine's versions and device (None where PyTorch does not import),
    and the reason when it does not."""
    proc = subprocess.run([sys.executable, str(PREFLIGHT), "--machine"], capture_output=True, text=True)
    if proc.returncode != 0:
        return None, (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


def cuda_status(info: dict | None, reason: str) -> tuple[bool, str]:
    """Whether this Python's PyTorch sees a CUDA GPU (``info`` and ``reason``
    from :func:`probe_environment`), and a line that says so."""
    if info is None:
        return False, (f"gpu-check needs PyTorch with CUDA, and PyTorch does not import in {sys.executable} "
                       f"({reason}); run it with the Python that has it")
    if not info["cuda_available"]:
        build = "a CPU-only build" if info["cuda"] is None else f"a CUDA {info['cuda']} build"
        return False, (f"no CUDA GPU is visible (torch.cuda.is_available() is False; PyTorch {info['torch']}, "
                       f"{build}): gpu-check needs a machine with an NVIDIA GPU and a CUDA build of PyTorch")
    return True, f"PyTorch {info['torch']}, CUDA {info['cuda']}, {info['device']}"


def git_commit() -> tuple[str | None, bool]:
    """The checkout's commit and whether tracked files differ from it; None
    where there is no git or no repository (a copied tree)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True)
    except OSError:
        return None, False
    if head.returncode != 0:
        return None, False
    return head.stdout.strip(), bool(dirty.stdout.strip())


def source_md5(path: Path) -> str:
    """As Sphinx-Gallery hashes a source (text, any line ending)."""
    return hashlib.md5(path.read_text(encoding="utf-8").encode("utf-8")).hexdigest()


# Packages some pages import beyond the bare GPU machine's torch, numpy and
# matplotlib, and the line that says how to bring them (they are pinned in
# requirements-tutorials.txt).
OPTIONAL = {"transformers": "pip install --no-index --find-links wheels transformers "
                            "(wheels from pip download -d wheels transformers==<pin>)"}


def needs_more_gpus(path: Path, gpus: int) -> str:
    """Why the page is skipped on a machine with ``gpus`` GPUs, or ''."""
    need = NEEDS_GPUS.get(path.stem, 0)
    if gpus >= need:
        return ""
    return (f"needs {need} GPUs, the machine has {gpus}: with fewer its ranks run on the CPU (gloo), "
            "which is no GPU figure")


def missing_packages(path: Path) -> list[str]:
    """The packages of ``OPTIONAL`` that the page imports and this Python lacks."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    return sorted(name for name in imported & set(OPTIONAL) if importlib.util.find_spec(name) is None)


# --- what a page recorded ----------------------------------------------------------

def page_records(folder: Path) -> tuple[list[dict], str]:
    """The records of the page run in ``folder`` (:data:`FIGURES`), and why
    they could not be read ('' where they could): a run goes on past one
    page's unreadable file."""
    try:
        return read_records(folder / FIGURES), ""
    except (OSError, ValueError) as err:
        return [], f"{FIGURES} unreadable: {err}"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def fractions(records: list[dict]) -> list[float]:
    """The fractions of the work bound the records hold, as the page printed them."""
    return [round(r["fraction"], 2) for r in records if _number(r.get("fraction"))]


def key_lines(records: list[dict], output: str) -> list[str]:
    """The lines the site shows of a run: each record's line, in the order
    the page printed them; before an indented one (a timing's row), the line
    of the output it sits under ("inference (causal, forward):"), once."""
    lines = [ln.rstrip() for ln in output.splitlines()]

    def indent(line):
        return len(line) - len(line.lstrip())

    shown, taken, at = [], set(), 0
    for line in (str(r.get("line", "")).rstrip() for r in records):
        if line in lines[at:]:
            i = lines.index(line, at)
            header = next((j for j in range(i - 1, -1, -1) if lines[j].strip() and indent(lines[j]) < indent(line)),
                          None)
            if header is not None and header not in taken:
                shown.append(lines[header])
            taken |= {i, header}
            at = i + 1
        shown.append(line)
    return shown


def peak_text(peak: dict | None) -> str:
    """"peak 812.4 MiB CUDA" (allocated) or "peak 1320.0 MiB RSS" (CPU)."""
    if not peak:
        return ""
    if peak.get("cuda_mib") is not None:
        return f"peak {peak['cuda_mib']:.1f} MiB CUDA"
    return f"peak {peak['rss_mib']:.1f} MiB RSS" if peak.get("rss_mib") is not None else ""


def summarize(stem: str, ok: bool, seconds: float, records: list[dict], *, mode: str = "",
              peak: dict | None = None, status: str | None = None, last: str = "") -> str:
    """The one-line summary of a page, from its records: status, mode, time,
    peak memory, the fractions of the work bound, its training and serving
    lines, the data-parallel gradients; where it failed, ``last`` (the last
    line it printed)."""
    status = status or ("PASS" if ok else "FAIL")
    line = f"{status:4s} {stem:40s}" + (f" {mode:5s}" if mode else "") + f" {seconds:7.1f} s"
    if peak_text(peak):
        line += f"  {peak_text(peak)}"
    if fractions(records):
        line += "  fractions of bound: " + ", ".join(f"{f:.2f}" for f in fractions(records))
    training = [r for r in records if r.get("kind") == "throughput" and "training" in str(r.get("label"))]
    for r in training + [r for r in records if r.get("kind") == "serving"]:
        line += f"  | {str(r.get('line', '')).strip()}"
    steps = [(r.get("world_size"), r.get("max_difference")) for r in records if r.get("kind") == "data_parallel"]
    if steps:
        line += "  | data-parallel gradients: " + ", ".join(
            f"world size {w} {f'{d:.1e}' if _number(d) else 'not measured'}" for w, d in steps)
    if not ok:
        line += f"  | {last[:160] or '(no output)'}"
    return line


# --- running a page ------------------------------------------------------------------

def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the page's process group (the page and everything it
    started), SIGKILL to what is left after ``GRACE_S`` or once the page ends."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing of the group is left
        pass
    proc.wait()


def run_script(argv: list[str], folder: Path, limit: float, env: dict, log_name: str) -> tuple[int | None, float]:
    """Run ``argv`` in ``folder`` in a process group of its own, standard
    output and error into ``folder/log_name`` as they come; past ``limit``
    seconds the group is stopped. Returns (exit status, None when stopped;
    seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(folder / log_name, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(argv, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            returncode = None
        _stop_group(proc)  # also after a normal end: no process of a page outlives it
    return returncode, time.perf_counter() - start


class PageRun(NamedTuple):
    passed: bool
    seconds: float
    output: str  # what it printed, standard output and error as they came
    stopped: bool  # past its limit


def run_page(path: Path, folder: Path, limit: float, env: dict, *, why: str = "its limit") -> PageRun:
    """Run one page in ``folder``, stopped past ``limit`` seconds (``why``:
    whose limit, for the line that says so); the figures it prints are
    recorded in ``folder/figures.jsonl`` (:data:`FIGURES`)."""
    for old in [*folder.glob("figure_*.png"), folder / "peak.json", folder / FIGURES]:
        old.unlink(missing_ok=True)  # a second run into the same folder
    env = {**env, FIGURES_ENV: str((folder / FIGURES).resolve())}
    returncode, seconds = run_script([sys.executable, str(PAGE_RUNNER), str(path)], folder, limit, env, "output.txt")
    if returncode is None:
        with open(folder / "output.txt", "a", encoding="utf-8") as log:
            log.write(f"\ngpu-check: {path.stem} stopped after {limit:.0f} s ({why})\n")
    output = (folder / "output.txt").read_text(encoding="utf-8", errors="replace")
    return PageRun(returncode == 0, seconds, output, returncode is None)


def figures(folder: Path) -> list[str]:
    return sorted((p.name for p in folder.glob("figure_*.png")), key=lambda n: int(re.sub(r"\D", "", n) or 0))


# --- the preflight -------------------------------------------------------------------

def run_preflight(out: Path, limit: float, env: dict) -> dict:
    returncode, seconds = run_script([sys.executable, str(PREFLIGHT)], out, limit, env, "preflight.txt")
    text = (out / "preflight.txt").read_text(encoding="utf-8", errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if returncode is None:
        lines.append(f"preflight: stopped after {limit:.0f} s (its limit): the probes after the last line "
                     "did not finish")
        with open(out / "preflight.txt", "a", encoding="utf-8") as log:
            log.write(lines[-1] + "\n")
    status = "pass" if returncode == 0 else "cut" if returncode is None else "fail"
    return {"status": status, "seconds": round(seconds, 1), "limit_s": round(limit, 1), "lines": lines}


# --- the plan ------------------------------------------------------------------------

def load_durations(src_dir: Path) -> dict[str, float]:
    """Each page's CPU build duration at full size, in seconds (``.github/tutorial-durations.json``)."""
    path = Path(src_dir) / DURATIONS
    if not path.exists():
        return {}
    return {stem: float(rec["seconds"]) for stem, rec in json.loads(path.read_text()).get("tutorials", {}).items()
            if "seconds" in rec}


def load_gpu_record(src_dir: Path) -> tuple[dict[tuple[str, str], float], float | None, str | None]:
    """From the recorded GPU run (``gpu-results/summary.json``, written by
    ``record``): the seconds of each (page, mode) that passed, the
    preflight's seconds where it passed, and which run it was (None where
    none is recorded)."""
    path = Path(src_dir) / RESULTS.name / RECORD_FILE
    if not path.exists():
        return {}, None, None
    rec = json.loads(path.read_text())
    seconds = {(stem, run["mode"]): float(run["seconds"]) for stem, page in rec.get("pages", {}).items()
               for run in page.get("runs", []) if run.get("status") == "pass" and run.get("seconds")}
    pre = rec.get("preflight") or {}
    pre_s = float(pre["seconds"]) if pre.get("status") == "pass" and pre.get("seconds") else None
    about = f"{rec.get('device', 'a GPU')}, {rec.get('date', 'undated')}, commit {str(rec.get('commit'))[:7]}"
    return seconds, pre_s, about


class Estimate(NamedTuple):
    seconds: float
    source: str  # where the figure comes from, as the dry run and a not-run line say it


class Expected:
    """What each step is expected to take on the GPU machine: a recorded GPU
    run's duration for that page and mode where one passed, else the CPU
    build's duration times :data:`GPU_FACTOR` for the mode (a page with no
    CPU duration: :data:`UNKNOWN_CPU_S`); the preflight's recorded
    duration, else :data:`PREFLIGHT_EXPECTED_S`."""

    def __init__(self, src_dir: Path):
        self.cpu = load_durations(src_dir)
        self.gpu, self.gpu_preflight, self.gpu_run = load_gpu_record(src_dir)

    def page(self, stem: str, mode: str) -> Estimate:
        if (stem, mode) in self.gpu:
            return Estimate(self.gpu[stem, mode], "recorded GPU run")
        factor = max(GPU_FACTOR[mode], CUDA_COMPILES_FACTOR.get(stem, 0.0))
        if stem in self.cpu:
            return Estimate(self.cpu[stem] * factor, f"CPU {self.cpu[stem]:.1f} s x {factor:.1f}")
        return Estimate(UNKNOWN_CPU_S * factor, f"no CPU duration: {UNKNOWN_CPU_S:.0f} s x {factor:.1f}")

    def preflight(self) -> Estimate:
        if self.gpu_preflight is not None:
            return Estimate(self.gpu_preflight, "recorded GPU run")
        return Estimate(PREFLIGHT_EXPECTED_S, "assumed")

    def known(self, stem: str) -> bool:
        return stem in self.cpu or any(s == stem for s, _ in self.gpu)

    def describe(self) -> str:
        """Where the expected times come from, and the factors assumed."""
        factors = ", ".join(f"{'full size' if m == 'full' else 'quick mode'} x{f:.1f}" for m, f in GPU_FACTOR.items())
        factors += "; in either mode at least " + ", ".join(f"x{f:.1f} for {stem}"
                                                            for stem, f in CUDA_COMPILES_FACTOR.items())
        factors += " (they compile more on CUDA)"
        record = (f"a recorded GPU run's own duration where {RESULTS.name}/{RECORD_FILE} has one that passed "
                  f"({self.gpu_run}: {len(self.gpu)} page runs), else " if self.gpu_run else
                  f"no GPU run recorded ({RESULTS.name}/{RECORD_FILE}): ")
        return (f"expected times: {record}the CPU build's duration ({DURATIONS.as_posix()}) times a CPU-to-GPU "
                f"factor, assumed until a GPU run is recorded: {factors}; a page with no CPU duration counts as "
                f"{UNKNOWN_CPU_S:.0f} s (the CPU budget); the preflight as "
                + (f"{self.gpu_preflight:.0f} s (recorded)" if self.gpu_preflight is not None else
                   f"{PREFLIGHT_EXPECTED_S:.0f} s (assumed)"))


def page_order(stems: list[str], expected: Expected, mode: str) -> list[str]:
    """:data:`FULL_SIZE_FIRST` in its order, then the other pages, shortest
    expected in ``mode`` first (a page with no duration on record after
    those with one)."""
    def key(stem):
        first = FULL_SIZE_FIRST.index(stem) if stem in FULL_SIZE_FIRST else len(FULL_SIZE_FIRST)
        return (first, not expected.known(stem), expected.page(stem, mode).seconds, reading_order_key(stem))
    return sorted(stems, key=key)


def fits(estimate: Estimate, left: float) -> bool:
    """Whether a step expected to take ``estimate`` starts with ``left`` seconds left."""
    return left >= max(estimate.seconds, MIN_START_S)


class Step(NamedTuple):
    stem: str  # "preflight" for the preflight
    mode: str  # "full", "quick"; "" for the preflight
    expected: Estimate
    start: float | None  # seconds from the start of the run; None where it does not fit


def schedule(stems: list[str], expected: Expected, stages: list[str], take, announce=None) -> None:
    """The steps of a run, for the plan and the run alike: every page at full
    size (:func:`page_order`), then quick mode for the pages that did not
    get a full-size run, in the same order. ``take(stem, mode, estimate)``
    runs a step where it fits and says whether it did; ``announce(mode,
    stems)`` starts each stage."""
    quick = stems
    if "full" in stages:
        if announce:
            announce("full", stems)
        quick = [s for s in page_order(stems, expected, "full") if not take(s, "full", expected.page(s, "full"))]
    if "quick" in stages:
        if announce:
            announce("quick", quick)
        for stem in page_order(quick, expected, "quick"):
            take(stem, "quick", expected.page(stem, "quick"))


def plan(stems: list[str], expected: Expected, limit: float, stages: list[str],
         preflight_limit: float = PREFLIGHT_LIMIT_S) -> list[Step]:
    """The run's timeline as expected (:func:`schedule`): the preflight, then
    each step that fits what is left of ``limit``, by its expected time. A
    step that does not fit has ``start`` None; the run's own decisions are
    the same ones, taken against its real clock."""
    steps, now = [], 0.0

    def take(stem, mode, estimate):
        nonlocal now
        start = now if fits(estimate, limit - now) else None
        now += estimate.seconds if start is not None else 0.0
        steps.append(Step(stem, mode, estimate, start))
        return start is not None

    if "preflight" in stages:
        pre = expected.preflight()
        take("preflight", "", pre._replace(seconds=min(pre.seconds, preflight_limit)))
    schedule(stems, expected, stages, take)
    return steps


def pages_of(src_dir: Path, pattern: str) -> list[Path]:
    return sorted((p for p in tutorial_sources(src_dir) if re.search(pattern, p.stem)),
                  key=lambda p: reading_order_key(p.stem))


def page_env(out: Path, quick: bool) -> dict:
    """The pages' environment: the toolkit importable, one compile cache
    under ``out`` for every page, quick mode or none."""
    cache = (out / "compile-cache").resolve()
    env = {**os.environ, "MPLBACKEND": "agg", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
    env.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's "USDT ... profiler_start" lines
    env.pop("TUTORIALS_QUICK", None)
    if quick:
        env["TUTORIALS_QUICK"] = "1"
    return env


def print_plan(args, pages: list[Path], expected: Expected, status: str) -> list[Step]:
    """The dry run: the timeline :func:`plan` expects, from the expected
    times and their sources, and every page that will not fit."""
    out = args.out
    skipped = {p.stem: missing_packages(p) for p in pages if missing_packages(p)}
    too_few = {p.stem: needs_more_gpus(p, args.gpus) for p in pages if needs_more_gpus(p, args.gpus)}
    steps = plan([p.stem for p in pages if p.stem not in skipped and p.stem not in too_few], expected, args.limit,
                 args.stages, args.preflight_limit)
    print(f"gpu-check plan (dry run: nothing runs); {status}; planned for {args.gpus} GPU"
          f"{'' if args.gpus == 1 else 's'}")
    print(f"overall limit {args.limit:.0f} s, each page at most {args.page_limit:.0f} s of its own; every page "
          f"compiles into {out / 'compile-cache'} (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR)")
    print(expected.describe())
    print("timeline, in seconds from the start:")
    end = 0.0
    for step in steps:
        if step.start is None:
            continue
        end = step.start + step.expected.seconds
        where = out / "preflight.txt" if step.stem == "preflight" else f"{out / step.stem / step.mode}/"
        limit = f", limit {min(args.preflight_limit, args.limit):.0f} s" if step.stem == "preflight" else ""
        print(f"  {step.start:5.0f} - {end:5.0f}  {step.stem:40s} {step.mode:5s} "
              f"expected {step.expected.seconds:4.0f} s "
              f"({step.expected.source}{limit}) -> {where}")
    print(f"  {end:5.0f} - {args.limit:5.0f}  {args.limit - end:.0f} s left, expected unused: no other step fits")
    ran = {(s.stem, s.mode) for s in steps if s.start is not None}
    missed = [s for s in steps if s.start is None and s.mode == "full"]
    if missed:
        print(f"will not fit at full size ({len(missed)} pages):")
        for s in missed:
            quick = f"expected {expected.page(s.stem, 'quick').seconds:.0f} s"
            instead = (f"runs in quick mode instead ({quick})" if (s.stem, "quick") in ran else
                       f"not run in quick mode either ({quick}, does not fit)" if "quick" in args.stages else
                       "not run (no quick stage)")
            print(f"  {s.stem}: expected {s.expected.seconds:.0f} s at full size ({s.expected.source}); {instead}")
    elif "full" in args.stages:
        print("every page fits at full size")
    missed_quick = [s for s in steps if s.start is None and s.mode == "quick" and "full" not in args.stages]
    if missed_quick:
        print(f"will not fit in quick mode ({len(missed_quick)} pages): "
              + ", ".join(f"{s.stem} (expected {s.expected.seconds:.0f} s)" for s in missed_quick))
    for stem, missing in skipped.items():
        print(f"skipped, a package missing in this Python: {stem} needs {', '.join(missing)}")
    for stem, why in too_few.items():
        print(f"skipped: {stem} {why}")
    print(f"files: {out}/PAGE/MODE/{{output.txt, {FIGURES}, figure_N.png, peak.json}}; "
          f"summary -> {out / 'summary.json'} (rewritten after every step)")
    if args.bundle:
        print(f"brought back: {args.bundle / 'summary.json'} and {args.bundle / BUNDLE_ARCHIVE} (the run without "
              "its compile cache), rewritten after every step")
    return steps


# --- a run ---------------------------------------------------------------------------

class Run:
    """The state of one run: the clock against ``--limit``, and the summary,
    rewritten after every step."""

    def __init__(self, args, info: dict | None, status: str, start: float):
        self.args, self.out, self.start = args, args.out, start
        commit, dirty = (args.commit, False) if args.commit else git_commit()
        self.summary = {"status": status, "started": datetime.datetime.now(datetime.timezone.utc)
                        .isoformat(timespec="seconds"), "commit": commit, "commit_dirty": dirty,
                        "environment": info or {}, "limit_s": args.limit, "stages": list(args.stages),
                        "preflight": None, "pages": [], "seconds": 0.0, "totals": {}}

    def left(self) -> float:
        return self.args.limit - (time.monotonic() - self.start)

    def save(self) -> None:
        self.summary["seconds"] = round(time.monotonic() - self.start, 1)
        self.summary["totals"] = totals(self.summary["pages"])
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1) + "\n")
        if self.args.bundle:
            write_bundle(self.out, self.args.bundle)

    def add(self, entry: dict) -> None:
        print(entry["summary"], flush=True)
        self.summary["pages"].append(entry)
        self.save()

    def not_run(self, path: Path, mode: str, reason: str) -> None:
        line = f"---- {path.stem:40s} {mode:5s} not run: {reason}"
        self.add({"page": path.stem, "mode": mode, "status": "not run", "passed": None, "reason": reason,
                  "seconds": 0.0, "md5": source_md5(path), "summary": line})

    def page(self, path: Path, mode: str, own_limit: float, expected: Estimate) -> dict:
        """Run one page until ``own_limit`` or the overall limit, whichever
        comes first; ``expected``: what the plan expected it to take, kept in
        the summary beside what it took."""
        overall = self.left() < own_limit
        limit = self.left() if overall else own_limit
        why = "the overall limit of the run" if overall else f"its limit in {mode} mode"
        folder = self.out / path.stem / mode
        ran = run_page(path, folder, limit, page_env(self.out, mode == "quick"), why=why)
        status = "pass" if ran.passed else "cut" if ran.stopped and overall else "fail"
        peak = json.loads((folder / "peak.json").read_text()) if (folder / "peak.json").exists() else None
        records, unreadable = page_records(folder)
        last = ([ln for ln in ran.output.strip().splitlines() if ln.strip()][-1:] or ["(no output)"])[0]
        entry = {"page": path.stem, "mode": mode, "status": status,
                 "passed": True if ran.passed else (None if status == "cut" else False),
                 "seconds": round(ran.seconds, 1), "limit_s": round(limit, 1),
                 "expected_s": round(expected.seconds, 1), "expected_from": expected.source,
                 "fractions": fractions(records), "key_lines": key_lines(records, ran.output), "records": records,
                 **({"records_unreadable": unreadable} if unreadable else {}),
                 "peak_mib": peak, "figures": figures(folder), "folder": f"{path.stem}/{mode}", "md5": source_md5(path),
                 "summary": summarize(path.stem, ran.passed, ran.seconds, records, mode=mode, peak=peak,
                                      status="CUT" if status == "cut" else None, last=last)}
        if not ran.passed:
            entry["reason"] = last
        self.add(entry)
        return entry


def _archive(out: Path, target: Path, *, figures_too: bool) -> None:
    with tarfile.open(target, "w:gz") as tar:
        for path in sorted(out.rglob("*")):
            rel = path.relative_to(out)
            if rel.parts[0] == "compile-cache" or not path.is_file():
                continue
            if figures_too or path.suffix != ".png":
                tar.add(path, arcname=rel.as_posix())


def write_bundle(out: Path, bundle: Path) -> None:
    """Under ``bundle`` (``$OUT`` on the device machine): ``summary.json``
    and :data:`BUNDLE_ARCHIVE`, the run in ``out`` without its compile
    cache, each written beside and then moved into place, so that a run cut
    off mid-write still leaves the previous pair. Where the archive would pass
    the machine's limit for one file, it is written without the figures and
    the summary in it says so."""
    bundle.mkdir(parents=True, exist_ok=True)
    partial = bundle / (BUNDLE_ARCHIVE + ".part")
    _archive(out, partial, figures_too=True)
    if partial.stat().st_size > RETURN_LIMITS["file_bytes"]:
        summary = json.loads((out / RECORD_FILE).read_text())
        summary["figures_left_out"] = f"the archive with them passed {RETURN_LIMITS['file_bytes'] >> 20} MiB"
        (out / RECORD_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        _archive(out, partial, figures_too=False)
    os.replace(partial, bundle / BUNDLE_ARCHIVE)
    shutil.copy2(out / RECORD_FILE, bundle / (RECORD_FILE + ".part"))
    os.replace(bundle / (RECORD_FILE + ".part"), bundle / RECORD_FILE)


def totals(entries: list[dict]) -> dict:
    out = {}
    for mode in ("full", "quick"):
        rows = [e for e in entries if e["mode"] == mode]
        if rows:
            out[mode] = {status: sum(e["status"] == status for e in rows)
                         for status in ("pass", "fail", "cut", "skip", "not run")}
    return out


def total_line(run: Run) -> str:
    parts = []
    for mode, counts in run.summary["totals"].items():
        ran = counts["pass"] + counts["fail"] + counts["cut"]
        text = f"{mode}: {counts['pass']} of {ran} pages passed"
        text += "".join(f", {counts[s]} {label}" for s, label in
                        (("fail", "failed"), ("cut", "cut at the overall limit"),
                         ("skip", "skipped (a package or GPUs missing)"), ("not run", "not run (no time left)"))
                        if counts[s])
        parts.append(text)
    pre = run.summary["preflight"]
    if pre:
        parts.insert(0, f"preflight {'passed' if pre['status'] == 'pass' else pre['status'].upper()}")
    return (f"gpu-check: {'; '.join(parts) or 'nothing ran'}; {run.summary['seconds']:.0f} s of the "
            f"{run.args.limit:.0f} s limit")


def check(args) -> int:
    start = time.monotonic()  # the overall limit counts from here
    info, reason = probe_environment()
    ok, status = cuda_status(info, reason)
    expected, pages = Expected(args.source), pages_of(args.source, args.pages)
    if args.dry_run:
        if args.gpus is None:
            args.gpus = info.get("gpus", 0) if ok else LENT_GPUS
        print_plan(args, pages, expected, status)
        return 0 if pages else 1
    if not ok and not args.allow_cpu:
        print(f"error: {status}", file=sys.stderr)
        return 2
    if not pages:
        print(f"error: no tutorial matches {args.pages!r}", file=sys.stderr)
        return 1
    print(f"gpu-check: {status}; overall limit {args.limit:.0f} s", flush=True)
    run = Run(args, info, status, start)
    run.save()
    if "preflight" in args.stages:
        limit = min(args.preflight_limit, run.left())
        print(f"== preflight (limit {limit:.0f} s)", flush=True)
        pre = run_preflight(args.out, limit, page_env(args.out, quick=False))
        for line in pre["lines"]:
            print(f"   {line}")
        run.summary["preflight"] = pre
        run.save()
    runnable, gpus = {}, (info or {}).get("gpus", 0)
    for path in pages:
        missing, too_few = missing_packages(path), needs_more_gpus(path, gpus)
        if not missing and not too_few:
            runnable[path.stem] = path
            continue
        skipped = f"needs {', '.join(missing)}" if missing else too_few
        why = f"{skipped}, not installed here: " + "; ".join(OPTIONAL[m] for m in missing) if missing else too_few
        run.add({"page": path.stem, "mode": "full" if "full" in args.stages else "quick", "status": "skip",
                 "passed": None, "skipped": skipped, "seconds": 0.0, "fractions": [],
                 "md5": source_md5(path), "summary": f"SKIP {path.stem:40s} {why}"})

    def announce(mode, stems):
        stage = "full size" if mode == "full" else "quick mode"
        without = "without a full-size run " if mode == "quick" and "full" in args.stages else ""
        print(f"== {stage}, {len(stems)} pages {without}while they fit ({max(run.left(), 0):.0f} s left)", flush=True)

    def take(stem, mode, estimate):
        if fits(estimate, run.left()):
            run.page(runnable[stem], mode, args.page_limit, estimate)
            return True
        instead = "; quick mode instead, if it fits" if mode == "full" and "quick" in args.stages else ""
        run.not_run(runnable[stem], mode, f"expected {estimate.seconds:.0f} s ({estimate.source}), "
                    f"{max(run.left(), 0):.0f} s left of the overall limit{instead}")
        return False

    schedule(list(runnable), expected, args.stages, take, announce)
    run.save()
    print(total_line(run), flush=True)
    failed = any(e["status"] == "fail" for e in run.summary["pages"])
    return 1 if failed or (run.summary["preflight"] or {}).get("status") == "fail" else 0


# --- the command line ----------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-check", help="folder for everything a run writes")
    ap.add_argument("--limit", type=float, default=DEFAULT_LIMIT_S,
                    help=f"seconds for the whole run (default {DEFAULT_LIMIT_S:.0f})")
    ap.add_argument("--page-limit", type=float, default=PAGE_LIMIT_S,
                    help=f"seconds one page may take, in either mode (default {PAGE_LIMIT_S:.0f})")
    ap.add_argument("--preflight-limit", type=float, default=PREFLIGHT_LIMIT_S,
                    help=f"seconds the preflight may take (default {PREFLIGHT_LIMIT_S:.0f}; a CPU compiles slower)")
    ap.add_argument("--pages", default="", help="run only the pages whose name matches (a substring or regex)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"which stages, comma-separated (default {','.join(STAGES)})")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the expected timeline (each step's start and end, the factors assumed, "
                         "the pages that will not fit); run nothing")
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA (to test this script)")
    ap.add_argument("--gpus", type=int, help=f"the GPUs a dry run plans for (default: this machine's where it has "
                                             f"CUDA, else {LENT_GPUS}, a lent machine's); a run counts its own")
    ap.add_argument("--commit", help="the commit the pages are at, where this copy has no git")
    ap.add_argument("--bundle", type=Path,
                    help=f"also keep summary.json and {BUNDLE_ARCHIVE} (the run without its compile cache) here, "
                         "rewritten after every step: $OUT on a lent GPU machine")
    ap.add_argument("--source", type=Path, default=ROOT, help="the site folder whose tutorials/ run (tests)")
    args = ap.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        ap.error(f"unknown stage(s) {sorted(unknown)}: choose from {', '.join(STAGES)}")
    if args.bundle and not args.dry_run:
        out, bundle = args.out.resolve(), args.bundle.resolve()
        if out == bundle or bundle in out.parents or out in bundle.parents:
            ap.error(f"--out {args.out} and --bundle {args.bundle} overlap: the run (thousands of compiled "
                     "files) goes outside the folder that comes back, e.g. --out /tmp/gpu-check")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["record"]:
        return gpu_record.main(argv[1:])
    return check(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
