"""Planted faults: each one must fail its gate with an error line naming the
file (a successful build's log names every file too, so the assertions look
for the file and the error on the same line)."""

from __future__ import annotations

import random
import re
from xml.etree import ElementTree

import numpy as np
import pytest
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


def test_a_warning_in_a_tutorials_own_process_fails_the_strict_build(tmp_path):
    result = build(site_with(tmp_path, "missing_thumbnail.py"))
    assert result.returncode != 0, result.log[-3000:]
    assert error_lines(result.log, "no_such_thumbnail.png", "not found", "missing_thumbnail.py"), result.log[-3000:]
    assert error_lines(result.log, "tutorials/missing_thumbnail.py: 1 warning(s) while its page was generated")


def test_broken_cross_reference_fails_naming_the_file(tmp_path):
    result = build(site_with(tmp_path, "bad_link.py"))
    assert result.returncode != 0
    assert error_lines(result.log, "bad_link", "no_such_page", "WARNING"), result.log[-3000:]


def test_missing_image_fails_naming_the_file(tmp_path):
    result = build(site_with(tmp_path, "missing_image.py"))
    assert result.returncode != 0
    assert error_lines(result.log, "missing_image", "no_such_image.png", "WARNING"), result.log[-3000:]


def _observed(site, stem="observer") -> dict[str, str]:
    lines = [ln for ln in printed(site, stem).splitlines() if ": " in ln]
    return dict(ln.split(": ", 1) for ln in lines)


def _changed(site) -> list[str]:
    line = next(ln for ln in printed(site, "leaky").splitlines() if ln.startswith("changed "))
    return line.split(": ", 1)[1].split(", ")


def test_no_state_survives_a_tutorial(tmp_path):
    # leaky.py changes every kind of process-wide state it can reach and
    # checks that each change is in force; observer.py, built after it,
    # fails if it sees any of them (it prints what it sees either way). It
    # must also see what it sees when it runs alone.
    alone = make_site(tmp_path / "alone", tutorials=[FAULTS / "observer.py"])
    after = make_site(tmp_path / "after", tutorials=[FAULTS / "leaky.py", FAULTS / "observer.py"])
    for site in (alone, after):
        result = build(site)
        assert result.returncode == 0, result.log[-5000:]
    changed, expected, seen = _changed(after), _observed(alone), _observed(after)
    assert len(changed) >= 38, changed
    assert set(changed) <= set(seen), f"observer.py does not check {set(changed) - set(seen)}"
    assert seen.pop("leaked") == "nothing", seen
    leaked = {k: (seen.get(k), v) for k, v in expected.items() if k != "leaked" and seen.get(k) != v}
    assert not leaked, f"leaked (after leaky.py, alone): {leaked}"
    # And the build's seeds, whatever ran before.
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    assert seen["torch seed"] == str(torch.rand(1).item())
    assert seen["numpy seed"] == str(np.random.randint(0, 10**6))
    assert seen["random seed"] == str(random.randint(0, 10**6))


def test_no_state_survives_a_tutorial_in_a_spawned_process(tmp_path):
    # Where the build cannot fork (macOS, Windows, a CUDA context in the
    # build process) each tutorial runs in a fresh interpreter instead: the
    # same guarantees, and the memory figure of that process.
    site = make_site(tmp_path / "site", tutorials=[FAULTS / "leaky.py", FAULTS / "observer.py",
                                                   FIXTURES / "memory" / "b_holder.py"])
    result = build(site, env={"TUTORIALS_START_METHOD": "spawn"})
    assert result.returncode == 0, result.log[-5000:]
    assert _observed(site)["leaked"] == "nothing"
    rst = (site / "auto_tutorials" / "b_holder.rst").read_text()
    mb = float(re.search(r"Estimated memory usage:\*\*\s*([\d.]+) MB", rst).group(1))
    assert mb >= 20, f"a page holding 24 MB reports {mb} MB"


# --- a tutorial that ends its process -------------------------------------------

CRASHES = {
    "hard_exit": ("os._exit(", "its process ended with exit status 3 before its page was written"),
    "segfault": ("ctypes.string_at(0)", "its process was killed by SIGSEGV (a segmentation fault) at line {line}"),
    "oom_killed": ("os.kill(", ("its process was killed by SIGKILL (from outside the build: the out-of-memory "
                                "killer, or a person)")),
}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    site = make_site(tmp_path_factory.mktemp("crashes") / "site",
                     tutorials=[GOOD, *(FAULTS / f"{stem}.py" for stem in CRASHES), FAULTS / "leaves_a_process.py"])
    return build(site)


@pytest.mark.parametrize("stem", CRASHES)
def test_a_tutorial_that_ends_its_interpreter_fails_its_page_named(crashed, stem):
    code, message = CRASHES[stem]
    message = message.format(line=line_of(FAULTS / f"{stem}.py", code))
    assert crashed.returncode != 0
    assert error_lines(crashed.log, f"tutorials/{stem}.py: {message}"), crashed.log[-5000:]
    assert message in printed(crashed.src, stem)  # its page says why
    junit = ElementTree.parse(crashed.html / "sphinx-gallery" / "junit-results.xml").getroot()
    (case,) = [c for c in junit.iter("testcase") if c.get("classname") == stem]
    assert message in case.find("failure").get("message")
    assert not (crashed.src / "auto_tutorials" / f"{stem}.py.md5").exists(), "it would not run again"
    # The build went on with the other pages.
    assert printed(crashed.src, GOOD.stem) and printed(crashed.src, "leaves_a_process")


def test_a_process_a_tutorial_started_ends_with_it(crashed):
    import psutil

    pid = int(re.search(r"started process (\d+)", printed(crashed.src, "leaves_a_process")).group(1))
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, \
        "the process leaves_a_process.py started outlived it"
