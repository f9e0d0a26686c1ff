"""Planted faults: each one must fail its gate with a message naming the file."""

from __future__ import annotations


import matplotlib
import torch

from pages import soup
from sitebuild import FIXTURES, build, make_site, validate_site

FAULTS = FIXTURES / "faults"
GOOD = FIXTURES / "tutorials" / "tiny_text.py"


def site_with(tmp_path, *names):
    return make_site(tmp_path / "site", tutorials=[GOOD, *(FAULTS / n for n in names)])


def test_sys_exit_half_way_fails_the_build_naming_the_file(tmp_path):
    result = build(site_with(tmp_path, "exits.py"))
    assert result.returncode != 0, result.log[-3000:]
    assert "tutorials/exits.py ended the build half-way" in result.log


def test_code_that_never_runs_fails_validation_naming_the_file(tmp_path):
    result = build(site_with(tmp_path, "never_runs.py"))
    assert result.returncode != 0, result.log[-3000:]
    assert "tutorials/never_runs.py: ran but showed nothing" in result.log


def test_validator_catches_a_tutorial_changed_after_its_last_run(tmp_path):
    site = site_with(tmp_path)
    assert build(site).returncode == 0
    (site / "tutorials" / GOOD.name).write_text(GOOD.read_text() + "\nprint('edited')\n")
    check = validate_site(site)
    assert check.returncode == 1
    assert f"tutorials/{GOOD.name}: its current version did not finish running" in check.stderr


def test_time_limit_stops_a_slow_tutorial_and_names_it(tmp_path):
    result = build(site_with(tmp_path, "slow.py"), env={"TUTORIAL_TIME_LIMIT_S": "3"})
    assert result.returncode != 0
    assert "slow.py" in result.log
    assert "ran past the per-tutorial limit of 3 s" in result.log
    assert result.seconds < 100, "the sleeping tutorial was not stopped"


def test_broken_cross_reference_fails_naming_the_file(tmp_path):
    result = build(site_with(tmp_path, "bad_link.py"))
    assert result.returncode != 0
    assert "bad_link" in result.log and "no_such_page" in result.log


def test_missing_image_fails_naming_the_file(tmp_path):
    result = build(site_with(tmp_path, "missing_image.py"))
    assert result.returncode != 0
    assert "missing_image" in result.log and "no_such_image.png" in result.log


def test_global_state_does_not_leak_into_the_next_tutorial(tmp_path):
    site = make_site(tmp_path / "site", tutorials=[FAULTS / "leaky.py", FAULTS / "observer.py"])
    result = build(site)
    assert result.returncode == 0, result.log[-5000:]
    text = soup(site / "_build" / "html" / "auto_tutorials" / "observer.html").get_text(" ")
    torch.manual_seed(0)
    expected = {
        "dtype:": "torch.float32",
        "device:": "cpu",
        "first draw:": str(round(float(torch.rand(1)), 6)),
        "cache_size_limit:": str(torch._dynamo.config.cache_size_limit),
        "linewidth:": str(matplotlib.rcParamsDefault["lines.linewidth"]),
        "ignore-all filter:": "False",
    }
    for key, value in expected.items():
        assert f"{key} {value}" in text, f"{key} leaked: {text[text.find(key):][:60]!r}"
