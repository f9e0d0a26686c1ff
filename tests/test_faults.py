"""Planted faults: each one must fail its gate with an error line naming the
file (a successful build's log names every file too, so the assertions look
for the file and the error on the same line)."""

from __future__ import annotations

import random

import matplotlib
import numpy as np
import torch

from pages import printed
from sitebuild import FIXTURES, build, error_lines, line_of, make_site, validate_site

FAULTS = FIXTURES / "faults"
GOOD = FIXTURES / "tutorials" / "tiny_text.py"
# The slow fixtures sleep for 600 s: a build that takes less than this did
# not wait for the sleep to end, with room for a loaded or paused machine.
STOPPED_WITHIN_S = 300


def site_with(tmp_path, *names):
    return make_site(tmp_path / "site", tutorials=[GOOD, *(FAULTS / n for n in names)])


def test_sys_exit_half_way_fails_the_build_naming_the_file(tmp_path):
    site = site_with(tmp_path, "exits.py")
    result = build(site)
    assert result.returncode != 0, result.log[-3000:]
    line = line_of(FAULTS / "exits.py", "sys.exit(0)")
    assert error_lines(result.log, f"tutorials/exits.py called sys.exit(0) (or raised SystemExit) at line {line}"), \
        result.log[-3000:]
    out = printed(site, "exits")
    assert "called sys.exit(0)" in out and "second half, never reached" not in out, out


def test_another_fatal_error_keeps_its_own_message_and_exit_code(tmp_path):
    # A thumbnail number that is not a number: Sphinx's extension error
    # (exit status 2), not a tutorial calling sys.exit.
    result = build(site_with(tmp_path, "bad_thumbnail.py"))
    assert result.returncode == 2, (result.returncode, result.log[-3000:])
    assert "sys.exit" not in result.log
    assert error_lines(result.log, "tutorials/bad_thumbnail.py", "thumbnail_number"), result.log[-3000:]


def test_code_that_never_runs_fails_validation_naming_the_file(tmp_path):
    result = build(site_with(tmp_path, "never_runs.py"))
    assert result.returncode != 0, result.log[-3000:]
    assert error_lines(result.log, "error: tutorials/never_runs.py: ran but showed nothing")


def test_validator_catches_a_tutorial_changed_after_its_last_run(tmp_path):
    site = site_with(tmp_path)
    assert build(site).returncode == 0
    (site / "tutorials" / GOOD.name).write_text(GOOD.read_text() + "\nprint('edited')\n")
    check = validate_site(site)
    assert check.returncode == 1
    assert f"tutorials/{GOOD.name}: its current version did not finish running" in check.stderr


def test_validator_ignores_line_endings_as_sphinx_gallery_does(tmp_path):
    site = site_with(tmp_path)
    assert build(site).returncode == 0
    src = site / "tutorials" / GOOD.name
    src.write_bytes(src.read_bytes().replace(b"\n", b"\r\n"))  # a checkout with CRLF
    check = validate_site(site)
    assert check.returncode == 0, check.stderr


def test_validator_fails_when_the_pattern_matches_no_tutorial(tmp_path):
    site = site_with(tmp_path)
    result = build(site, env={"GALLERY_PATTERN": "no_such_tutorial"})
    assert result.returncode != 0, result.log[-3000:]
    assert error_lines(result.log, "error:", "'no_such_tutorial' matched no tutorial")


def test_time_limit_stops_a_slow_tutorial_and_names_it(tmp_path):
    result = build(site_with(tmp_path, "slow.py"), env={"TUTORIAL_TIME_LIMIT_S": "3"})
    assert result.returncode != 0
    # Stopped inside the sleep, not after it.
    line = line_of(FAULTS / "slow.py", "time.sleep(")
    assert error_lines(result.log, f"tutorials/slow.py ran past the per-tutorial limit of 3 s at line {line}"), \
        result.log[-3000:]
    assert result.seconds < STOPPED_WITHIN_S, "the sleeping tutorial was not stopped"


def test_time_limit_is_not_swallowed_by_except_exception(tmp_path):
    site = site_with(tmp_path, "slow_catches.py")
    result = build(site, env={"TUTORIAL_TIME_LIMIT_S": "3"})
    assert result.returncode != 0, result.log[-3000:]
    line = line_of(FAULTS / "slow_catches.py", "time.sleep(")
    assert error_lines(result.log, "tutorials/slow_catches.py ran past the per-tutorial limit of 3 s "
                                   f"at line {line}"), result.log[-3000:]
    out = printed(site, "slow_catches")
    assert "ran past the per-tutorial limit" in out, out  # the block's error is on the page ...
    assert "caught " not in out and "survived the time limit" not in out, out  # ... and nothing else
    assert result.seconds < STOPPED_WITHIN_S


def test_broken_cross_reference_fails_naming_the_file(tmp_path):
    result = build(site_with(tmp_path, "bad_link.py"))
    assert result.returncode != 0
    assert error_lines(result.log, "bad_link", "no_such_page", "WARNING"), result.log[-3000:]


def test_missing_image_fails_naming_the_file(tmp_path):
    result = build(site_with(tmp_path, "missing_image.py"))
    assert result.returncode != 0
    assert error_lines(result.log, "missing_image", "no_such_image.png", "WARNING"), result.log[-3000:]


def _observed(site) -> dict[str, str]:
    lines = [ln for ln in printed(site, "observer").splitlines() if ":" in ln]
    return dict(ln.split(":", 1) for ln in lines)


def test_global_state_does_not_leak_into_the_next_tutorial(tmp_path):
    # observer.py prints every setting leaky.py changes; after leaky.py it
    # must print what it prints when it runs alone.
    alone = make_site(tmp_path / "alone", tutorials=[FAULTS / "observer.py"])
    after = make_site(tmp_path / "after", tutorials=[FAULTS / "leaky.py", FAULTS / "observer.py"])
    for site in (alone, after):
        result = build(site)
        assert result.returncode == 0, result.log[-5000:]
    assert "changed dtype" in printed(after, "leaky")
    expected, seen = _observed(alone), _observed(after)
    assert len(expected) >= 18, expected
    leaked = {k: (seen.get(k), v) for k, v in expected.items() if seen.get(k) != v}
    assert not leaked, f"leaked (after leaky.py, alone): {leaked}"
    # And the values themselves: the build's seeds and the defaults.
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    assert expected["first draw"].strip() == str(round(float(torch.rand(1)), 6))
    assert expected["numpy global draw"].strip() == str(np.random.randint(0, 10**6))
    assert expected["random draw"].strip() == str(random.randint(0, 10**6))
    assert expected["dtype"].strip() == "torch.float32"
    assert expected["linewidth"].strip() == str(matplotlib.rcParamsDefault["lines.linewidth"])
    assert expected["anomaly detection"].strip() == "False"
    assert expected["leaked env"].strip() == "None"
