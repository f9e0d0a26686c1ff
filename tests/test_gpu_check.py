"""The GPU check (``scripts/gpu_check.py``) on a machine without a GPU: its
plan (a dry run, and a run against a monkeypatched CUDA machine and clock),
a page stopped past its limit, a real run of one page on the CPU, the record
of a run, and the site's page "GPU results" with the stamp's link to it
(``sphinxext/gpu_results.py``), built from a small recorded fixture."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest
import torch

from pages import soup
from sitebuild import FIXTURES, REPO, build, make_site

sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "sphinxext"))
import gpu_check  # noqa: E402
import gpu_results  # noqa: E402

SCRIPT = REPO / "scripts" / "gpu_check.py"
RECORDED = FIXTURES / "gpu_results"  # what `record` writes from fake_run(): the site test's record
TINY = [FIXTURES / "tutorials" / "tiny_plot.py", FIXTURES / "tutorials" / "tiny_text.py"]
H200 = {"cuda_available": True, "torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91300, "python": "3.12.3",
        "device": "NVIDIA H200", "triton": "3.6.0", "transformers": "5.17.0", "numpy": "2.3.5",
        "matplotlib": "3.10.8"}


def page_source(folder: Path, stems_and_code: dict[str, str], durations: dict[str, float] | None = None) -> Path:
    """A site folder whose ``tutorials/`` holds the given pages (and a
    durations file), for ``--source``."""
    (folder / "tutorials").mkdir(parents=True)
    for stem, code in stems_and_code.items():
        (folder / "tutorials" / f"{stem}.py").write_text(code)
    if durations is not None:
        (folder / ".github").mkdir()
        (folder / ".github" / "tutorial-durations.json").write_text(json.dumps(
            {"tutorials": {stem: {"seconds": s} for stem, s in durations.items()}}))
    return folder


# --- the plan --------------------------------------------------------------------------

# Pages of a made-up site: two of the reading order, the decision page
# (first at full size), the building blocks (expected at 4x the CPU build's
# time, as the decision page), and two the reading order does not list (one
# with no recorded duration). Durations: not in the order the pages are read.
PLAN_PAGES = ["ragged_batches_intro", "transformer_building_blocks", "packed_gpt_training",
              "which_attention_path", "zz_new_page", "aa_other_page"]
PLAN_DURATIONS = {"ragged_batches_intro": 6.0, "transformer_building_blocks": 56.0, "packed_gpt_training": 79.0,
                  "which_attention_path": 40.0, "aa_other_page": 30.0}
# FULL_SIZE_FIRST in its order, then the others shortest expected first, the unknown last
PLAN_FULL = ["which_attention_path", "ragged_batches_intro", "aa_other_page", "packed_gpt_training",
             "transformer_building_blocks", "zz_new_page"]
# At 540 s, CPU durations x 2.0 at full size and x 1.0 in quick mode (x 4.0
# in both for the decision page and the building blocks), a 30 s preflight:
# the building blocks (224 s) and the new page (90 s x 2) do not fit at full
# size; the new one fits in quick mode (90 s), the building blocks (224 s) not.
PLAN_TIMELINE = [(0, 30, "preflight", ""), (30, 190, "which_attention_path", "full"),
                 (190, 202, "ragged_batches_intro", "full"), (202, 262, "aa_other_page", "full"),
                 (262, 420, "packed_gpt_training", "full"), (420, 510, "zz_new_page", "quick")]


def test_the_plan_assumes_its_factors_and_keeps_the_decision_page_first():
    assert gpu_check.FULL_SIZE_FIRST == ["which_attention_path"]
    assert gpu_check.GPU_FACTOR == {"full": 2.0, "quick": 1.0}
    # issue 41: the pages that compile more on CUDA, at least 4x their CPU time
    assert {stem: f for stem, f in gpu_check.CUDA_COMPILES_FACTOR.items() if f >= 4.0}.keys() >= {
        "which_attention_path", "transformer_building_blocks", "packed_recurrent_layers"}
    assert gpu_check.STAGES == ("preflight", "full", "quick") and gpu_check.DEFAULT_LIMIT_S == 540


def test_the_full_size_order_is_the_short_list_then_the_others_shortest_expected_first(tmp_path):
    src = page_source(tmp_path / "site", {s: "" for s in PLAN_PAGES}, PLAN_DURATIONS)
    assert gpu_check.page_order(PLAN_PAGES, gpu_check.Expected(src), "full") == PLAN_FULL


def _timeline(text: str) -> list[tuple]:
    """The dry run's timeline rows: (start, end, step, mode)."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"^\s+(\d+) -\s+(\d+)  (\S+)\s+(full |quick)? +expected", line)
        if m:
            rows.append((int(m[1]), int(m[2]), m[3], (m[4] or "").strip()))
    return rows


def test_dry_run_prints_the_timeline_and_the_pages_that_do_not_fit_and_runs_nothing(tmp_path, capsys):
    src = page_source(tmp_path / "site", {s: "raise SystemExit('a dry run ran me')\n" for s in PLAN_PAGES},
                      PLAN_DURATIONS)
    out = tmp_path / "gpu-check"
    assert gpu_check.main(["--dry-run", "--source", str(src), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    print(text)
    assert "overall limit 540 s, each page at most 300 s of its own" in text and f"{out / 'compile-cache'}" in text
    assert ("no GPU run recorded (gpu-results/summary.json): the CPU build's duration "
            "(.github/tutorial-durations.json) times a CPU-to-GPU factor, assumed until a GPU run is recorded: "
            "full size x2.0, quick mode x1.0; in either mode at least x4.0 for which_attention_path, x4.0 for "
            "transformer_building_blocks, x4.0 for packed_attention_layer, x4.0 for packed_recurrent_layers (they "
            "compile more on CUDA); a page with "
            "no CPU duration counts as 90 s (the CPU budget); the preflight as 30 s (assumed)") in text
    assert _timeline(text) == PLAN_TIMELINE
    lines = text.splitlines()
    assert any(ln.strip().startswith("0 -    30  preflight") and f"(assumed, limit 45 s) -> {out / 'preflight.txt'}"
               in ln for ln in lines), text
    decision = next(ln for ln in lines if "which_attention_path " in ln and " full " in ln)
    assert "expected  160 s (CPU 40.0 s x 4.0)" in decision
    assert f"-> {out / 'which_attention_path' / 'full'}/" in decision
    assert "510 -   540  30 s left, expected unused: no other step fits" in [ln.strip() for ln in lines]
    missed = lines[lines.index("will not fit at full size (2 pages):") + 1:][:2]
    assert missed == [
        "  transformer_building_blocks: expected 224 s at full size (CPU 56.0 s x 4.0); not run in quick mode "
        "either (expected 224 s, does not fit)",
        "  zz_new_page: expected 180 s at full size (no CPU duration: 90 s x 2.0); runs in quick mode instead "
        "(expected 90 s)"], missed
    assert f"summary -> {out / 'summary.json'}" in text
    assert not out.exists(), "a dry run wrote files"


def test_the_dry_run_of_this_site_fits_the_decision_page_at_full_size(capsys):
    """Issue 35's condition: one command of 540 s, the decision page at full
    size in it, from the durations and the record this checkout holds."""
    assert gpu_check.main(["--dry-run", "--out", "gpu-check"]) == 0
    text = capsys.readouterr().out
    print(text)
    rows = _timeline(text)
    assert rows[0][2] == "preflight" and rows[1][2:] == ("which_attention_path", "full"), rows
    assert all(end <= 540 for _, end, _, _ in rows), rows
    # issue 41: on the lent machine's one GPU, the data-parallel page is skipped, named
    assert "planned for 1 GPU" in text.splitlines()[0]
    skipped = [ln.split()[1] for ln in text.splitlines() if ln.startswith("skipped: ")]
    assert skipped == ["data_parallel_packed_training"], skipped
    full = [stem for _, _, stem, mode in rows if mode == "full"]
    assert len(full) >= 6, f"fewer pages at full size than shortest-first gives: {full}"
    assert {stem for _, _, stem, _ in rows[1:]} | set(skipped) | {
        ln.split(":")[0].strip() for ln in text.splitlines() if ln.startswith("  ") and ": expected " in ln} \
        >= {p.stem for p in gpu_check.tutorial_sources(REPO) if not gpu_check.missing_packages(p)}, \
        "a page is neither in the timeline nor named as not fitting or skipped"
    capsys.readouterr()
    assert gpu_check.main(["--dry-run", "--out", "gpu-check", "--gpus", "2"]) == 0
    assert "skipped: " not in capsys.readouterr().out


class FakeMachine:
    """A CUDA machine and a clock for ``main``: each page "takes" the seconds
    given for it (or until its limit), and nothing runs."""

    def __init__(self, monkeypatch, seconds: dict[tuple[str, str], float], preflight_s: float = 40.0):
        self.now, self.calls, self.seconds = 0.0, [], seconds
        clock = types.SimpleNamespace(monotonic=lambda: self.now, perf_counter=lambda: self.now)
        monkeypatch.setattr(gpu_check, "time", clock)
        monkeypatch.setattr(gpu_check, "probe_environment", lambda: (dict(H200), ""))
        monkeypatch.setattr(gpu_check, "git_commit", lambda: ("f" * 40, False))
        monkeypatch.setattr(gpu_check, "run_page", self.run_page)
        monkeypatch.setattr(gpu_check, "run_preflight", self.run_preflight)
        self.preflight_s = preflight_s

    def run_preflight(self, out, limit, env):
        self.calls.append(("preflight", "", limit, env))
        self.now += self.preflight_s
        return {"status": "pass", "seconds": self.preflight_s, "limit_s": limit, "lines": ["versions: fake"]}

    def run_page(self, path, folder, limit, env, *, why):
        mode = folder.name
        self.calls.append((path.stem, mode, limit, env))
        takes = self.seconds.get((path.stem, mode), 1.0)
        self.now += min(takes, limit)
        folder.mkdir(parents=True, exist_ok=True)
        line = f"{path.stem}: speedup 2.00x, work bound 2.50x, fraction of bound 0.80"
        output = line + "\n"
        if takes > limit:
            output += f"gpu-check: {path.stem} stopped after {limit:.0f} s ({why})\n"
        (folder / "output.txt").write_text(output)
        speedup = {"kind": "speedup", "line": line, "label": path.stem, "speedup": 2.0, "bound": 2.5, "fraction": 0.8}
        (folder / gpu_check.FIGURES).write_text(json.dumps(speedup) + "\n")  # what the page would record
        (folder / "figure_1.png").write_bytes(b"png")
        return gpu_check.PageRun(takes <= limit, min(takes, limit), output, takes > limit)


# What the fake machine's pages take in the run below: the decision page
# passes, two short pages pass, the GPT page hangs past its own limit, and
# the new page, given quick mode, runs past the overall limit.
FAKE_SECONDS = {("which_attention_path", "full"): 100.0, ("packed_gpt_training", "full"): 1000.0,
                ("ragged_batches_intro", "full"): 10.0, ("aa_other_page", "full"): 50.0,
                ("zz_new_page", "quick"): 1000.0}


def test_a_run_follows_the_plan_on_a_fake_cuda_machine(tmp_path, monkeypatch, capsys):
    src = page_source(tmp_path / "site", {s: "" for s in PLAN_PAGES}, PLAN_DURATIONS)
    out = tmp_path / "gpu-check"
    machine = FakeMachine(monkeypatch, FAKE_SECONDS)
    code = gpu_check.main(["--source", str(src), "--out", str(out), "--page-limit", "200"])
    printed = capsys.readouterr().out
    print(printed)
    assert code == 1, "a page failed: exit status 1"
    calls = [(stem, mode, limit) for stem, mode, limit, _ in machine.calls]
    # 40 s preflight (its limit 45 s); the decision page 100 s (its own limit
    # 200 s); the intro 10 s; aa 50 s; the GPT page (expected 158 s) stopped
    # at 200 s, failed; the building blocks (224 s) and the new page (180 s)
    # do not fit at full size with 140 s left: quick mode, the building
    # blocks (224 s) do not fit either, the new page (90 s) starts, its limit
    # the overall one, and is cut there
    assert calls == [("preflight", "", 45.0), ("which_attention_path", "full", 200.0),
                     ("ragged_batches_intro", "full", 200.0), ("aa_other_page", "full", 200.0),
                     ("packed_gpt_training", "full", 200.0), ("zz_new_page", "quick", 140.0)]
    summary = json.loads((out / "summary.json").read_text())
    status = [(p["page"], p["mode"], p["status"]) for p in summary["pages"]]
    assert status == [("which_attention_path", "full", "pass"), ("ragged_batches_intro", "full", "pass"),
                      ("aa_other_page", "full", "pass"), ("packed_gpt_training", "full", "fail"),
                      ("transformer_building_blocks", "full", "not run"), ("zz_new_page", "full", "not run"),
                      ("transformer_building_blocks", "quick", "not run"), ("zz_new_page", "quick", "cut")]
    # a page that failed at full size gets no quick run: it had its full run
    assert ("packed_gpt_training", "quick") not in {(p, m) for p, m, _ in status}
    blocks = next(p for p in summary["pages"] if p["page"] == "transformer_building_blocks" and p["mode"] == "full")
    assert blocks["reason"] == ("expected 224 s (CPU 56.0 s x 4.0), 140 s left of the overall limit; quick mode "
                                "instead, if it fits")
    decision = summary["pages"][0]
    assert (decision["expected_s"], decision["expected_from"]) == (160.0, "CPU 40.0 s x 4.0")
    # its figures, from what it recorded beside its output
    assert decision["fractions"] == [0.8] and decision["records"][0]["speedup"] == 2.0
    assert decision["key_lines"] == ["which_attention_path: speedup 2.00x, work bound 2.50x, fraction of bound 0.80"]
    # one compile cache under --out for every page; quick mode only in stage 3
    caches = {env["TORCHINDUCTOR_CACHE_DIR"] for *_, env in machine.calls} | \
        {env["TRITON_CACHE_DIR"] for *_, env in machine.calls}
    assert caches == {str((out / "compile-cache" / "inductor").resolve()),
                      str((out / "compile-cache" / "triton").resolve())}
    assert [env.get("TUTORIALS_QUICK") for s, mode, _, env in machine.calls if s != "preflight"] == \
        [None] * 4 + ["1"]
    assert summary["environment"]["device"] == "NVIDIA H200" and summary["commit"] == "f" * 40
    assert summary["totals"] == {"full": {"pass": 3, "fail": 1, "cut": 0, "skip": 0, "not run": 2},
                                 "quick": {"pass": 0, "fail": 0, "cut": 1, "skip": 0, "not run": 1}}
    failed = next(ln for ln in printed.splitlines() if ln.startswith("FAIL packed_gpt_training"))
    assert "stopped after 200 s (its limit in full mode)" in failed
    cut = next(ln for ln in printed.splitlines() if ln.startswith("CUT  zz_new_page"))
    assert "stopped after 140 s (the overall limit of the run)" in cut
    assert printed.splitlines()[-1] == (
        "gpu-check: preflight passed; full: 3 of 4 pages passed, 1 failed, 2 not run (no time left); "
        "quick: 0 of 1 pages passed, 1 cut at the overall limit, 1 not run (no time left); 540 s of the 540 s limit")


def test_the_next_plan_expects_what_the_recorded_run_took(tmp_path, monkeypatch, capsys):
    """A run, recorded with ``record`` into the site's gpu-results/, gives the
    next dry run its durations: the preflight's and those of the pages that
    passed, said to be recorded; the others keep the CPU factor."""
    src = page_source(tmp_path / "site", {s: "" for s in PLAN_PAGES}, PLAN_DURATIONS)
    out = tmp_path / "gpu-check"
    FakeMachine(monkeypatch, FAKE_SECONDS)
    gpu_check.main(["--source", str(src), "--out", str(out), "--page-limit", "200"])
    monkeypatch.undo()
    gpu_check.main(["record", str(out), "--into", str(src / "gpu-results")])
    capsys.readouterr()
    assert gpu_check.main(["--dry-run", "--source", str(src), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    print(text)
    assert ("expected times: a recorded GPU run's own duration where gpu-results/summary.json has one that passed "
            "(NVIDIA H200, ") in text and "commit fffffff: 3 page runs), else the CPU build's" in text
    assert "the preflight as 40 s (recorded)" in text
    # recorded: preflight 40 s, decision page 100 s, intro 10 s, aa 50 s; the
    # GPT page failed (CPU x 2.0: 158 s); the building blocks (CPU x 4.0:
    # 224 s) do not fit; the new page (180 s) fits at full size now
    assert _timeline(text) == [(0, 40, "preflight", ""), (40, 140, "which_attention_path", "full"),
                               (140, 150, "ragged_batches_intro", "full"), (150, 200, "aa_other_page", "full"),
                               (200, 358, "packed_gpt_training", "full"), (358, 538, "zz_new_page", "full")]
    decision = next(ln for ln in text.splitlines() if "which_attention_path " in ln)
    assert "expected  100 s (recorded GPU run)" in decision
    assert "  transformer_building_blocks: expected 224 s at full size (CPU 56.0 s x 4.0); not run in quick mode " \
           "either (expected 224 s, does not fit)" in text


def test_a_page_cut_at_the_overall_limit_is_named_and_not_failed(tmp_path, monkeypatch, capsys):
    src = page_source(tmp_path / "site", {s: "" for s in PLAN_PAGES[:2]}, PLAN_DURATIONS)
    out = tmp_path / "gpu-check"
    # 40 s preflight: the intro (expected 12 s) starts with 110 s left, less
    # than the page limit of 120 s, and runs past them: cut; no time for the
    # building blocks (expected 224 s) at full size or in quick mode
    machine = FakeMachine(monkeypatch, {("ragged_batches_intro", "full"): 1000.0})
    code = gpu_check.main(["--source", str(src), "--out", str(out), "--limit", "150", "--page-limit", "120"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert [c[:3] for c in machine.calls[1:]] == [("ragged_batches_intro", "full", 110.0)]
    cut = next(ln for ln in printed.splitlines() if ln.startswith("CUT  ragged_batches_intro"))
    assert "stopped after 110 s (the overall limit of the run)" in cut
    summary = json.loads((out / "summary.json").read_text())
    cut = next(p for p in summary["pages"] if p["page"] == "ragged_batches_intro")
    assert cut["status"] == "cut" and cut["passed"] is None
    assert [(p["page"], p["mode"], p["status"]) for p in summary["pages"]] == [
        ("ragged_batches_intro", "full", "cut"), ("transformer_building_blocks", "full", "not run"),
        ("transformer_building_blocks", "quick", "not run")], "a page ran with no time left"


def test_the_data_parallel_page_is_skipped_named_on_one_gpu_and_runs_on_two(tmp_path, monkeypatch, capsys):
    """Issue 41: with one GPU the data-parallel page would run gloo ranks on
    the CPU at the CUDA sizes: a CPU figure, so it is skipped, named."""
    pages = ["ragged_batches_intro", "data_parallel_packed_training"]
    src = page_source(tmp_path / "site", {s: "" for s in pages}, {s: 5.0 for s in pages})
    for gpus, ran in ((1, ["ragged_batches_intro"]), (2, pages)):
        machine = FakeMachine(monkeypatch, {})
        monkeypatch.setattr(gpu_check, "probe_environment", lambda: ({**H200, "gpus": gpus}, ""))
        out = tmp_path / f"out{gpus}"
        assert gpu_check.main(["--source", str(src), "--out", str(out), "--stages", "full"]) == 0
        printed = capsys.readouterr().out
        assert sorted(s for s, *_ in machine.calls) == sorted(ran), (gpus, machine.calls)
        summary = json.loads((out / "summary.json").read_text())
        dp = next(p for p in summary["pages"] if p["page"] == "data_parallel_packed_training")
        if gpus == 1:
            assert dp["status"] == "skip" and dp["skipped"].startswith("needs 2 GPUs, the machine has 1"), dp
            assert "SKIP data_parallel_packed_training" in printed and "1 skipped (a package or GPUs missing)" in printed
        else:
            assert dp["status"] == "pass", dp


def test_quick_mode_alone_runs_every_page_while_it_fits(tmp_path, monkeypatch, capsys):
    src = page_source(tmp_path / "site", {s: "" for s in PLAN_PAGES}, PLAN_DURATIONS)
    machine = FakeMachine(monkeypatch, {})
    assert gpu_check.main(["--source", str(src), "--out", str(tmp_path / "out"), "--stages", "quick"]) == 0
    assert [(s, m) for s, m, _, _ in machine.calls] == [(s, "quick") for s in
                                                        ["which_attention_path", "ragged_batches_intro",
                                                         "aa_other_page", "packed_gpt_training",
                                                         "transformer_building_blocks", "zz_new_page"]]


# --- real processes, on the CPU ----------------------------------------------------------

HANGS = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open("child.pid", "w").write(str(child.pid))
print("started, and now hanging", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie nobody reaped has ended


SPEEDUP = "layer: speedup 3.00x, work bound 4.00x, fraction of bound 0.75"
RECORDS_SPEEDUP = ("from ragged_site.records import record\n"
                   f"print(record('speedup', {SPEEDUP!r}, label='layer', speedup=3.0, bound=4.0, fraction=0.75))\n")


def test_a_page_past_its_limit_is_stopped_named_and_the_others_go_on(tmp_path):
    src = page_source(tmp_path / "site", {"a_hangs": HANGS, "b_passes": RECORDS_SPEEDUP})
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--allow-cpu", "--source", str(src), "--out", str(out),
                           "--stages", "quick", "--page-limit", "25"], capture_output=True, text=True,
                          timeout=300)  # a hang guard only; the page's limit is 25 s: the runner
    #                                   imports torch, seconds on a busy machine
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    failed = next(ln for ln in lines if ln.startswith("FAIL a_hangs"))
    assert failed.endswith("| gpu-check: a_hangs stopped after 25 s (its limit in quick mode)"), failed
    assert any(ln.startswith("PASS b_passes") and "fractions of bound: 0.75" in ln for ln in lines), lines
    kept = (out / "a_hangs" / "quick" / "output.txt").read_text()
    assert "started, and now hanging" in kept, "what the page printed before it was stopped is lost"
    child = int((out / "a_hangs" / "quick" / "child.pid").read_text())
    assert not _alive(child), "a process the stopped page started is still running"
    summary = json.loads((out / "summary.json").read_text())
    assert [(p["page"], p["status"]) for p in summary["pages"]] == [("a_hangs", "fail"), ("b_passes", "pass")]
    assert summary["pages"][1]["key_lines"] == [SPEEDUP] and summary["pages"][1]["fractions"] == [0.75]


# A page's figures as it prints them, and, in the page that records them, as
# records (ragged_site/records.py): a speedup, a table row under its header,
# a training and a serving line, a data-parallel step; then a line no record
# holds.
FIGURES_PRINTED = [
    ("speedup", SPEEDUP, {"label": "layer", "speedup": 3.0, "bound": 4.0, "fraction": 0.75}),
    ("timing", "  packed     0.41 ms (IQR   0.01)", {"label": "packed", "median_ms": 0.41, "iqr_ms": 0.01, "runs": 20}),
    ("throughput", ("hf training: ragged 900 tokens/s, padded 500 tokens/s, speedup 1.80x, work bound 2.00x, "
                    "fraction 0.90"),
     {"label": "hf training", "tokens_per_s": {"ragged": 900, "padded": 500}, "speedup": 1.8, "bound": 2.0,
      "fraction": 0.9}),
    ("serving", ("serving: continuous 800 tokens/s, static 400 tokens/s, speedup 2.00x, slot bound 2.50x, "
                 "fraction 0.80"),
     {"label": "serving", "tokens_per_s": {"continuous": 800, "static": 400}, "speedup": 2.0, "bound": 2.5,
      "fraction": 0.8}),
    ("data_parallel", "data-parallel step: world size 2, gradient max difference to one process 2.2e-08",
     {"label": "DDP", "world_size": 2, "max_difference": 2.2e-08}),
    ("a_kind_nobody_reads", "something new: 4.5", {"value": 4.5}),
]


def _figures_page(recorded: bool) -> str:
    code = ["from ragged_site.records import record"]
    for kind, line, figures in FIGURES_PRINTED:
        code += ["print('inference (causal, forward):')"] if kind == "timing" else []  # the row's header
        code.append(f"print(record({kind!r}, {line!r}, **{figures!r}))" if recorded else f"print({line!r})")
    return "\n".join(code + ["print('varlen: speedup 9.99x, work bound 9.99x, fraction of bound 0.99')", ""])


def test_a_figure_reaches_the_summary_through_its_record_not_its_printed_text(tmp_path):
    """Issue 38: two pages print the same lines; only the one that records
    them has fractions, training, serving and data-parallel lines and key
    lines in its summary line and its entry in summary.json."""
    src = page_source(tmp_path / "site", {"a_records": _figures_page(True), "b_prints": _figures_page(False)})
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--allow-cpu", "--source", str(src), "--out", str(out),
                           "--stages", "quick"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {ln.split()[1]: ln for ln in proc.stdout.splitlines() if ln.startswith("PASS ")}
    assert lines["a_records"].endswith(
        "fractions of bound: 0.75, 0.90, 0.80  | " + FIGURES_PRINTED[2][1] + "  | " + FIGURES_PRINTED[3][1]
        + "  | data-parallel gradients: world size 2 2.2e-08"), lines["a_records"]
    assert lines["b_prints"].endswith(" MiB RSS"), lines["b_prints"]  # nothing after its peak: no record
    recorded, printed = json.loads((out / "summary.json").read_text())["pages"]
    assert recorded["records"] == gpu_check.read_records(out / "a_records" / "quick" / gpu_check.FIGURES)
    assert [r["kind"] for r in recorded["records"]] == [kind for kind, _, _ in FIGURES_PRINTED]
    assert recorded["fractions"] == [0.75, 0.9, 0.8]
    assert recorded["key_lines"] == [SPEEDUP, "inference (causal, forward):"] + [
        line for _, line, _ in FIGURES_PRINTED[1:]], recorded["key_lines"]
    assert (printed["records"], printed["fractions"], printed["key_lines"]) == ([], [], [])
    assert not (out / "b_prints" / "quick" / gpu_check.FIGURES).exists()


def test_gpu_check_stops_at_once_naming_cuda():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "CUDA" in proc.stderr and "torch.cuda.is_available() is False" in proc.stderr


def _rec(kind, line, **figures):
    return {"kind": kind, "line": line, **figures}


def test_gpu_check_summary_lines():
    records = [_rec("speedup", "forward: speedup 4.48x, work bound 5.19x, fraction of bound 0.86", fraction=0.8631),
               _rec("throughput", "training: ragged 10240 tokens/s, padded 3094 tokens/s, speedup 3.31x, work bound "
                    "3.91x, fraction 0.85", label="training", tokens_per_s={"ragged": 10240}, fraction=0.8466),
               _rec("throughput", "decode: ragged 100 tokens/s", label="decode", tokens_per_s={"ragged": 100}),
               _rec("serving", "serving: continuous 5120 tokens/s, static 2048 tokens/s", label="serving"),
               _rec("timing", "  loop     3.44 ms (IQR   0.37)  peak     2.2 MiB  [flash varlen x48]",
                    label="loop", median_ms=3.44),
               _rec("fraction", "not a number", fraction=None), {"kind": "no_line_nor_numbers"}]
    line = gpu_check.summarize("packed_gpt_training", True, 52.34, records, mode="quick",
                               peak={"cuda_mib": 812.44, "rss_mib": 2000.0})
    assert line.startswith("PASS packed_gpt_training") and " quick " in line
    assert "52.3 s" in line and "peak 812.4 MiB CUDA" in line
    assert line.endswith("fractions of bound: 0.86, 0.85  | training: ragged 10240 tokens/s, padded 3094 tokens/s, "
                         "speedup 3.31x, work bound 3.91x, fraction 0.85  | serving: continuous 5120 tokens/s, "
                         "static 2048 tokens/s"), line
    assert gpu_check.fractions(records) == [0.86, 0.85]
    # the same lines printed, not recorded: none of them in the line
    assert gpu_check.summarize("page", True, 1.0, []).endswith("1.0 s")
    failed = gpu_check.summarize("page", False, 1.0, [], last="RuntimeError: boom")
    assert failed.startswith("FAIL page") and failed.endswith("| RuntimeError: boom")
    # the data-parallel page: one record per wrapper and launch
    steps = [_rec("data_parallel", "data-parallel step: ...", label=w, world_size=n, max_difference=d)
             for w, n, d in (("DDP", 2, 2.2e-08), ("FSDP2", 2, 3.1e-08), ("DDP", 1, 4.0e-07), ("DDP", 1, None))]
    assert gpu_check.summarize("data_parallel_packed_training", True, 61.0, steps).endswith(
        "| data-parallel gradients: world size 2 2.2e-08, world size 2 3.1e-08, world size 1 4.0e-07, "
        "world size 1 not measured")


def test_key_lines_keep_the_line_an_indented_one_sits_under():
    output = ("48 sequences\ninference (causal, forward):\n  varlen   not available: needs CUDA\n"
              "  flex     15.03 ms (IQR   1.10)  peak     7.7 MiB\n"
              "decision: loop\n    kernels: CPU flash x48\nGQA: loop\n    kernels: CPU flash x48\n")
    records = [_rec("timing", "  flex     15.03 ms (IQR   1.10)  peak     7.7 MiB", label="flex"),
               _rec("timing", "  packed   1.00 ms (IQR   0.10)", label="packed"),  # printed by a process of its own
               _rec("decision", "decision: loop"), _rec("kernels", "    kernels: CPU flash x48"),
               _rec("kernels", "    kernels: CPU flash x48")]
    assert gpu_check.key_lines(records, output) == [
        "inference (causal, forward):", "  flex     15.03 ms (IQR   1.10)  peak     7.7 MiB",
        "  packed   1.00 ms (IQR   0.10)", "decision: loop", "    kernels: CPU flash x48", "GQA: loop",
        "    kernels: CPU flash x48"]


def repository_copy(target: Path) -> Path:
    """What the device machine gets: the tracked files and the untracked
    ones git does not ignore, without ``.git``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target / name)
    return target


def returned(out: Path) -> list[Path]:
    """The files under ``out`` the device machine sends back, asserting it
    would send every one (RETURN_LIMITS)."""
    limits = gpu_check.RETURN_LIMITS
    files = [p for p in out.rglob("*") if p.is_file()]
    assert all(not p.is_symlink() for p in out.rglob("*")), "a link does not come back"
    assert len(files) <= limits["files"], files
    assert all(p.stat().st_size <= limits["file_bytes"] for p in files), [(p, p.stat().st_size) for p in files]
    assert sum(p.stat().st_size for p in files) <= limits["total_bytes"]
    assert all(len(p.relative_to(out).parts) - 1 <= limits["depth"] for p in files), files
    return files


def test_the_lease_command_runs_a_page_and_brings_it_back_within_the_limits(tmp_path):
    """The README's first command on a lent GPU, as it is (with --allow-cpu
    and one page), in a copy of the repository without .git, with OUT an
    empty folder: every stage on the CPU, what lands in OUT fits what the
    device machine sends back, and ``record`` takes it. The page fits at full
    size, so quick mode has nothing to run."""
    copy = repository_copy(tmp_path / "repo")
    before = sorted(p.relative_to(copy) for p in copy.rglob("*"))
    out, tmpdir, bin_dir = tmp_path / "OUT", tmp_path / "tmp", tmp_path / "bin"
    for folder in (out, tmpdir, bin_dir):
        folder.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # the machine's, as `python`
    (bin_dir / "python").chmod(0o755)
    sha = "5" * 40
    assert gpu_check.LEASE_COMMAND.startswith("python scripts/gpu_check.py ") and "SHA" in gpu_check.LEASE_COMMAND
    assert gpu_check.LEASE_COMMAND in (REPO / "README.md").read_text(), "the README quotes another first command"
    command = gpu_check.LEASE_COMMAND.replace("SHA", sha) + " --allow-cpu --pages intro --preflight-limit 240"
    env = {**os.environ, "OUT": str(out), "TMPDIR": str(tmpdir), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    # a cold compile on two busy CPU cores takes longer than the GPU machine's 45 s
    proc = subprocess.run(["bash", "-c", command], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=900)  # a hang guard
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.relative_to(copy) for p in copy.rglob("*") if "__pycache__" not in p.parts) == \
        [p for p in before if "__pycache__" not in p.parts], "the run wrote into the repository's copy"
    lines = proc.stdout.splitlines()
    assert [ln.split(",")[0] for ln in lines if ln.startswith("== ")] == [
        "== preflight (limit 240 s)", "== full size", "== quick mode"]
    assert any(ln.startswith("== quick mode, 0 pages without a full-size run") for ln in lines), lines
    for probe in ("versions: torch", "varlen_attn:", "SDPA kernel: bfloat16, causal", "torch.compile:",
                  "flex_attention:", "cuDNN first call:"):
        assert any(ln.strip().startswith(probe) for ln in lines), probe
    assert any(ln.startswith("PASS ragged_batches_intro") and " full " in ln and "fractions of bound:" in ln
               for ln in lines), lines
    run = tmpdir / "gpu-check"  # the run itself, outside the copy
    folder = run / "ragged_batches_intro" / "full"
    assert "nn.Linear" in (folder / "output.txt").read_text()
    assert (folder / "figure_1.png").is_file() and json.loads((folder / "peak.json").read_text())["rss_mib"] > 0
    assert not (run / "ragged_batches_intro" / "quick").exists()
    assert (run / "preflight.txt").read_text().rstrip().endswith("preflight: every probe ran")
    assert any((run / "compile-cache" / "inductor").iterdir()), "the compile cache is not under --out"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["commit"] == sha
    assert [(p["page"], p["mode"], p["status"]) for p in summary["pages"]] == [("ragged_batches_intro", "full", "pass")]
    assert summary["preflight"]["status"] == "pass" and summary["environment"]["torch"] == torch.__version__
    speedup = next(r for r in summary["pages"][0]["records"] if r["kind"] == "speedup")
    assert speedup["line"].startswith("nn.Linear: speedup") and speedup["line"] in summary["pages"][0]["key_lines"]
    assert summary["pages"][0]["fractions"][0] == round(speedup["fraction"], 2)
    assert summary["pages"][0]["figures"] == ["figure_1.png"]
    assert summary["pages"][0]["expected_s"] == round(2.0 * gpu_check.load_durations(REPO)["ragged_batches_intro"], 1)
    # what comes back: the summary as a plain file, and the run without its compile cache
    files = returned(out)
    assert sorted(p.name for p in files) == sorted([gpu_check.BUNDLE_ARCHIVE, "summary.json"])
    assert json.loads((out / "summary.json").read_text()) == summary
    with tarfile.open(out / gpu_check.BUNDLE_ARCHIVE) as tar:
        names = tar.getnames()
    assert "ragged_batches_intro/full/figure_1.png" in names and "preflight.txt" in names
    assert "ragged_batches_intro/full/figures.jsonl" in names
    assert not [n for n in names if n.startswith("compile-cache")]
    # recorded from what came back (the archive, or its folder), with the commit the command gave
    for source in (out / gpu_check.BUNDLE_ARCHIVE, out):
        into = tmp_path / "record" / source.name
        assert gpu_check.main(["record", str(source), "--into", str(into), "--allow-cpu"]) == 0
        rec = json.loads((into / "summary.json").read_text())
        assert rec["commit"] == sha and rec["pages"]["ragged_batches_intro"]["figures"] == [
            "figures/ragged_batches_intro/figure_1.png"]
        assert (into / "figures" / "ragged_batches_intro" / "figure_1.png").read_bytes() == \
            (folder / "figure_1.png").read_bytes()


def test_the_run_may_not_land_in_the_folder_that_comes_back(tmp_path):
    for out in (tmp_path / "OUT" / "gpu-check", tmp_path / "OUT"):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--out", str(out), "--bundle", str(tmp_path / "OUT")])
    assert gpu_check.parse_args(["--out", str(tmp_path / "run"), "--bundle", str(tmp_path / "OUT")]).bundle


def test_an_archive_past_the_limit_of_one_file_comes_back_without_its_figures(tmp_path, monkeypatch):
    run, out = tmp_path / "run", tmp_path / "OUT"
    (run / "page" / "full").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    (run / "page" / "full" / "output.txt").write_text("printed\n")
    (run / "page" / "full" / gpu_check.FIGURES).write_text('{"kind": "speedup", "line": "printed"}\n')
    (run / "page" / "full" / "figure_1.png").write_bytes(os.urandom(200_000))
    (run / "compile-cache" / "inductor").mkdir(parents=True)
    (run / "compile-cache" / "inductor" / "graph.py").write_bytes(os.urandom(300_000))
    gpu_check.write_bundle(run, out)
    with tarfile.open(out / gpu_check.BUNDLE_ARCHIVE) as tar:
        assert sorted(tar.getnames()) == ["page/full/figure_1.png", "page/full/figures.jsonl",
                                          "page/full/output.txt", "summary.json"]
    monkeypatch.setitem(gpu_check.RETURN_LIMITS, "file_bytes", 100_000)
    gpu_check.write_bundle(run, out)
    returned(out)
    with tarfile.open(out / gpu_check.BUNDLE_ARCHIVE) as tar:
        assert sorted(tar.getnames()) == ["page/full/figures.jsonl", "page/full/output.txt", "summary.json"]
    assert "figures_left_out" in json.loads((out / "summary.json").read_text())


def test_gpu_check_keeps_each_figure_a_page_shows(tmp_path):
    page = tmp_path / "figures.py"
    page.write_text("import matplotlib.pyplot as plt\n"
                    "plt.plot([1, 2]); plt.show()\n"
                    "plt.subplots(); plt.subplots(); plt.show()\n"
                    "from ragged_site.records import record\n"
                    "print(record('fraction', __name__, fraction=0.5))\n")
    folder = tmp_path / "out" / "figures"
    ran = gpu_check.run_page(page, folder, 120, {**os.environ, "RAGGED_SITE_FIGURES": str(tmp_path / "elsewhere")})
    assert ran.passed and not ran.stopped, ran.output
    assert ran.output.strip() == "__main__"
    assert gpu_check.page_records(folder) == ([{"kind": "fraction", "line": "__main__", "fraction": 0.5}], "")
    assert gpu_check.figures(folder) == ["figure_1.png", "figure_2.png", "figure_3.png"]
    assert json.loads((folder / "peak.json").read_text())["cuda_mib"] is None
    page.write_text("raise SystemExit('boom')\n")
    ran = gpu_check.run_page(page, folder, 120, dict(os.environ))
    assert not ran.passed and "boom" in ran.output and not gpu_check.figures(folder)
    assert gpu_check.page_records(folder) == ([], ""), "the records of an earlier run are kept"


# --- the record ----------------------------------------------------------------------------

def fake_run(out: Path) -> Path:
    """The --out folder of a made-up H200 run of the two tiny pages:
    ``tiny_plot`` passed in quick mode and at full size (with a figure),
    ``tiny_text`` passed in quick mode and did not fit at full size. Each
    page's MD5 is made up (an earlier version of it)."""
    out.mkdir(parents=True)
    figure = RECORDED / "figures" / "tiny_plot" / "figure_1.png"
    for mode in ("quick", "full"):
        (out / "tiny_plot" / mode).mkdir(parents=True)
        shutil.copy2(figure, out / "tiny_plot" / mode / "figure_1.png")
    plot_lines = ["tiny: speedup 2.10x, work bound 2.50x, fraction of bound 0.84",
                  "  packed   0.41 ms (IQR   0.01)  peak    12.5 MiB  [flash varlen]"]

    def entry(page, mode, seconds, key, figures, md5):
        return {"page": page, "mode": mode, "status": "pass", "passed": True, "seconds": seconds, "limit_s": 120.0,
                "fractions": [0.84] if key else [], "key_lines": key,
                "records": [{"kind": "timing" if ln.startswith(" ") else "speedup", "line": ln} for ln in key],
                "peak_mib": {"cuda_mib": 64.5, "rss_mib": 900.0}, "figures": figures, "folder": f"{page}/{mode}",
                "md5": md5, "summary": f"PASS {page}"}

    md5 = "1" * 32  # the site test makes it tiny_plot's own: a page the run saw as it is
    summary = {"status": "PyTorch 2.11.0+cu130, CUDA 13.0, NVIDIA H200", "started": "2026-12-04T10:00:00+00:00",
               "commit": "abc1234" + "0" * 33, "commit_dirty": False, "environment": H200, "limit_s": 330.0,
               "seconds": 301.5,
               "preflight": {"status": "pass", "seconds": 21.0, "limit_s": 60.0,
                             "lines": ["versions: torch 2.11.0+cu130, CUDA 13.0, cuDNN 91300, triton 3.6.0",
                                       "SDPA kernel: bfloat16, causal, (2, 8, 1024, 64): "
                                       "aten::_scaled_dot_product_cudnn_attention"]},
               "pages": [entry("tiny_plot", "quick", 3.2, plot_lines[:1], ["figure_1.png"], md5),
                         entry("tiny_text", "quick", 2.0, [], [], "0" * 32),
                         entry("tiny_plot", "full", 8.4, plot_lines, ["figure_1.png"], md5),
                         {"page": "tiny_text", "mode": "full", "status": "not run", "passed": None,
                          "reason": "recorded 130 s, 100 s left of the overall limit", "seconds": 0.0,
                          "md5": "0" * 32, "summary": "---- tiny_text"}],
               "totals": {"quick": {"pass": 2}, "full": {"pass": 1, "not run": 1}}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return out


def test_record_round_trip(tmp_path):
    out = fake_run(tmp_path / "gpu-check")
    into = tmp_path / "gpu-results"
    (into / "figures" / "gone_page").mkdir(parents=True)  # a figure of an earlier record
    (into / "figures" / "gone_page" / "figure_1.png").write_bytes(b"old")
    (into / "README.md").write_text("kept")
    assert gpu_check.main(["record", str(out), "--into", str(into)]) == 0
    rec = json.loads((into / "summary.json").read_text())
    assert (rec["commit"], rec["date"], rec["device"]) == ("abc1234" + "0" * 33, "2026-12-04", "NVIDIA H200")
    assert rec["versions"] == {k: H200[k] for k in ("torch", "cuda", "cudnn", "triton", "transformers", "numpy",
                                                    "matplotlib", "python")}
    plot = rec["pages"]["tiny_plot"]
    assert [r["mode"] for r in plot["runs"]] == ["quick", "full"] and plot["figures_from"] == "full"
    assert plot["runs"][1]["key_lines"][1].endswith("[flash varlen]")
    assert [r["kind"] for r in plot["runs"][1]["records"]] == ["speedup", "timing"]  # the decision page reads them
    assert plot["runs"][1]["peak_mib"] == {"cuda_mib": 64.5, "rss_mib": 900.0}
    assert plot["figures"] == ["figures/tiny_plot/figure_1.png"]
    assert (into / plot["figures"][0]).read_bytes() == (out / "tiny_plot" / "full" / "figure_1.png").read_bytes()
    assert rec["pages"]["tiny_text"]["runs"][1]["status"] == "not run"
    assert not (into / "figures" / "gone_page").exists() and (into / "README.md").read_text() == "kept"
    # the committed fixture is what `record` writes from this run
    assert rec == json.loads((RECORDED / "summary.json").read_text())
    # no commit, no record; a CPU run is no GPU record
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "commit": None}))
    with pytest.raises(SystemExit, match="--commit"):
        gpu_check.main(["record", str(out), "--into", str(tmp_path / "again")])
    assert gpu_check.main(["record", str(out), "--into", str(tmp_path / "again"), "--commit", "1" * 40]) == 0
    (out / "summary.json").write_text(json.dumps({**summary, "environment": {**H200, "cuda_available": False}}))
    with pytest.raises(SystemExit, match="without a CUDA GPU"):
        gpu_check.main(["record", str(out), "--into", str(tmp_path / "cpu")])


# --- the page "GPU results" --------------------------------------------------------------

def _results(site: Path):
    return soup(site / "_build" / "html" / "gpu_results.html").select_one("article")


def _section(page, stem: str):
    """The section of ``stem`` on the results page, found by its label."""
    return page.find(id=f"gpu-results-{stem.replace('_', '-')}").find_parent("section")


def _stamp(site: Path, stem: str):
    return soup(site / "_build" / "html" / "auto_tutorials" / f"{stem}.html").select_one(".build-stamp")


def test_results_page_and_stamp_links_from_a_recorded_fixture(tmp_path):
    site = make_site(tmp_path / "site", tutorials=TINY)
    shutil.rmtree(site / "gpu-results")
    shutil.copytree(RECORDED, site / "gpu-results")
    record = json.loads((site / "gpu-results" / "summary.json").read_text())
    record["pages"]["tiny_plot"]["md5"] = gpu_results.source_md5(site / "tutorials" / "tiny_plot.py")
    (site / "gpu-results" / "summary.json").write_text(json.dumps(record))
    result = build(site, "-D", "plot_gallery=0")
    assert result.returncode == 0, result.log[-5000:]
    page = _results(site)
    text = page.get_text(" ", strip=True)
    heading = "Measured on an NVIDIA H200 with PyTorch 2.11.0+cu130 at commit abc1234, 2026-12-04"
    assert heading in [h.get_text(strip=True).rstrip("#") for h in page.select("h2")], text
    assert "Not the figures on the tutorial pages" in text and "No GPU run" not in text
    assert "cuDNN 91300" in text and "aten::_scaled_dot_product_cudnn_attention" in text
    blocks = [pre.get_text() for pre in _section(page, "tiny_plot").select("pre")]
    assert any("tiny: speedup 2.10x" in b and "[flash varlen]" in b for b in blocks), blocks
    images = _section(page, "tiny_plot").select("img")
    assert len(images) == 1 and (site / "_build" / "html" / images[0]["src"]).is_file()
    assert "peak CUDA memory allocated 64.5 MiB" in _section(page, "tiny_plot").get_text(" ", strip=True)
    text_page = _section(page, "tiny_text").get_text(" ", strip=True)
    assert "changed since this run" in text_page and "not run (recorded 130 s" in text_page
    # each stamp links to its page's section; one page changed since the run
    stamp = _stamp(site, "tiny_plot")
    assert f"GPU figures for this page, apart from this build's: {heading}; see GPU results" in \
        stamp.get_text(" ", strip=True).replace(" ;", ";")
    assert [a["href"] for a in stamp.select("a")] == ["../gpu_results.html#gpu-results-tiny-plot"]
    assert "(an earlier version of this page)" in _stamp(site, "tiny_text").get_text(" ", strip=True)

    # no record: the page says so, and so does every stamp, linked to it
    shutil.rmtree(site / "gpu-results")
    result = build(site, "-D", "plot_gallery=0")
    assert result.returncode == 0, result.log[-5000:]
    paragraphs = [p.get_text(strip=True) for p in _results(site).select("p")]
    assert paragraphs[0] == gpu_results.NONE_YET == "No GPU run has been recorded yet."
    assert not _results(site).select("img") and "Measured on" not in _results(site).get_text()
    for stem in ("tiny_plot", "tiny_text"):
        stamp = _stamp(site, stem)
        assert "No GPU run of this page has been recorded yet: see GPU results" in stamp.get_text(" ", strip=True)
        assert [a["href"] for a in stamp.select("a")] == ["../gpu_results.html#gpu-results"]


def test_the_article_before_a_device_name():
    assert gpu_results._a("NVIDIA H200") == "an" and gpu_results._a("Tesla T4") == "a"
    assert gpu_results._a("AMD Instinct MI300X") == "an" and gpu_results._a("GeForce RTX 4090") == "a"
