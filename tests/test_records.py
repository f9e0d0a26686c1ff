"""Figures as data (``ragged_site.records``): what a page prints as a figure
is also a record, numbers and the printed line, in the file
``$RAGGED_SITE_FIGURES`` names; nothing is written where it is unset."""

from __future__ import annotations

import torch

from sitebuild import REPO  # noqa: F401  (puts this checkout's packages on the path)
from ragged_site.measuring.bound import speedup_line, throughput_line
from ragged_site.measuring.tables import print_timings
from ragged_site.measuring.timing import Timing
from ragged_site.records import FIGURES_ENV, read_records, record


def test_nothing_is_written_where_no_file_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv(FIGURES_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert record("speedup", "x: speedup 2.00x", speedup=2.0) == "x: speedup 2.00x"
    assert list(tmp_path.iterdir()) == []
    assert read_records(tmp_path / "none.jsonl") == []


def test_records_keep_the_line_and_the_numbers_in_order(monkeypatch, tmp_path):
    path = tmp_path / "page.figures.jsonl"
    monkeypatch.setenv(FIGURES_ENV, str(path))
    record("difference", "max difference 1e-07", max_difference=torch.tensor(1e-7), tolerance=None)
    record("timing", "  padded   nan ms", median_ms=float("nan"), spread=(1, 2))
    first, second = read_records(path)
    assert first == {"kind": "difference", "line": "max difference 1e-07",
                     "max_difference": torch.tensor(1e-7).item(), "tolerance": None}
    assert second == {"kind": "timing", "line": "  padded   nan ms", "median_ms": None, "spread": [1, 2]}


def test_the_printing_helpers_record_what_they_print(monkeypatch, tmp_path, capsys):
    path = tmp_path / "page.figures.jsonl"
    monkeypatch.setenv(FIGURES_ENV, str(path))
    padded, packed = Timing.of([4.0, 4.1, 4.2, 4.3, 4.4]), Timing.of([2.0, 2.1, 2.2, 2.3, 2.4])
    print(speedup_line("forward", padded, packed, 2.5))
    print(throughput_line("training", 300.0, 100.0, 4.0))
    print_timings({"padded": padded, "flash": "needs CUDA"})
    printed = [ln for ln in capsys.readouterr().out.splitlines()]
    records = read_records(path)
    assert [r["line"] for r in records] == printed
    speed, rate, timed, missing = records
    assert (speed["kind"], speed["speedup"], speed["bound"], speed["within_noise"]) == (
        "speedup", padded.median_ms / packed.median_ms, 2.5, False)
    assert abs(speed["fraction"] - speed["speedup"] / 2.5) < 1e-12
    assert rate["tokens_per_s"] == {"ragged": 300.0, "padded": 100.0} and rate["fraction"] == 0.75
    assert (timed["label"], timed["median_ms"], timed["peak_mib"]) == ("padded", padded.median_ms, None)
    assert missing == {"kind": "timing", "line": "  flash  not available: needs CUDA", "label": "flash",
                       "reason": "needs CUDA"}


def test_a_record_cut_off_by_a_stopped_page_is_left_out(tmp_path):
    path = tmp_path / "page.figures.jsonl"
    path.write_text('{"kind": "speedup", "line": "a"}\n{"kind": "timing", "li')
    assert read_records(path) == [{"kind": "speedup", "line": "a"}]
