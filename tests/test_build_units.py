"""Unit tests of the build's callables, without a Sphinx build."""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sitebuild import REPO

sys.path.insert(0, str(REPO / "sphinxext"))
sys.path.insert(0, str(REPO / "scripts"))
import check_versions  # noqa: E402
import downloads  # noqa: E402
import page_parts  # noqa: E402
import tutorial_isolation  # noqa: E402
from gallery_layout import PACKAGES  # noqa: E402


# --- a process per tutorial: time limit, crashes, memory, sys.exit -------------

UNIT = "tutorials/unit.py"


def _run_as_tutorial(src_file, code):
    """In the child: ``code`` compiled as the tutorial's own lines, as
    Sphinx-Gallery runs them."""
    exec(compile(code, src_file, "exec"), {})


#: The limit of the calls whose value a test checks: a guard against a hang,
#: not a time any of them should take, so that a loaded machine (a spawned
#: interpreter's start-up took minutes beside check-versions) fails nothing.
HANG_S = 600


def _isolated(tmp_path, code, limit_s=HANG_S, method="fork"):
    src_file = str(tmp_path / "tutorials" / "unit.py")
    return tutorial_isolation.run_isolated(_run_as_tutorial, (src_file, code), name=UNIT, src_file=src_file,
                                           limit_s=limit_s, method=method)


def test_time_limit_kills_what_except_baseexception_would_swallow(tmp_path):
    # A tutorial that catches everything, around a blocking call.
    code = "import time\nwhile True:\n    try:\n        time.sleep(600)\n    except BaseException:\n        pass\n"
    ended = _isolated(tmp_path, code, limit_s=1)
    assert ended.failure == (f"{UNIT} ran past the per-tutorial limit of 1 s at line 4 "
                             "(set TUTORIAL_TIME_LIMIT_S to change it); its process was killed"), ended
    assert ended.seconds < 30, ended.seconds
    assert 'unit.py", line 4 in <module>' in ended.stack


def test_time_limit_kills_a_tutorial_that_takes_over_the_signals(tmp_path):
    # Its own handlers for the signals a build might send: still killed, only
    # without the line (its stack could not be written).
    code = ("import signal\nfor s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGALRM):\n"
            "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass\n")
    ended = _isolated(tmp_path, code, limit_s=1)
    assert ended.failure.startswith(f"{UNIT} ran past the per-tutorial limit of 1 s"), ended
    assert ended.seconds < 30, ended.seconds


@pytest.mark.parametrize("code, failure", [
    ("import os\nos._exit(3)\n", f"{UNIT}: its process ended with exit status 3 before its page was written"),
    ("import ctypes\nctypes.string_at(0)\n", f"{UNIT}: its process was killed by SIGSEGV (a segmentation fault) "
                                            "at line 2"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
     f"{UNIT}: its process was killed by SIGKILL (from outside the build: the out-of-memory killer"),
], ids=["os._exit", "segfault", "oom-killer"])
def test_a_crash_ends_with_a_failure_naming_the_tutorial(tmp_path, code, failure):
    ended = _isolated(tmp_path, code)
    assert not ended.answered and ended.failure.startswith(failure), ended


def test_what_the_call_returns_or_raises_comes_back(tmp_path):
    assert _isolated(tmp_path, "x = 1\n").answered
    ended = tutorial_isolation.run_isolated(divmod, (7, 2), name=UNIT, src_file="", limit_s=HANG_S)
    assert ended.value == (3, 1) and ended.failure is None
    ended = _isolated(tmp_path, "raise ValueError('planted')\n")
    assert isinstance(ended.raised, ValueError) and str(ended.raised) == "planted"
    ended = _isolated(tmp_path, "raise KeyboardInterrupt\n")  # not an Exception: a failure, named
    assert ended.raised is None and ended.failure == f"{UNIT}: raised KeyboardInterrupt() at line 1", ended


def test_nothing_the_tutorial_started_outlives_it(tmp_path):
    import psutil

    pid_file = tmp_path / "pid"
    code = ("import subprocess, sys, threading, time\n"
            "threading.Thread(target=time.sleep, args=(600,)).start()\n"  # not a daemon
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n")
    ended = _isolated(tmp_path, code)
    assert ended.answered and ended.seconds < 30, ended
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "a process the tutorial started outlived it"
        time.sleep(0.1)


def test_spawn_runs_the_call_in_a_fresh_interpreter_under_the_time_limit(tmp_path):
    ended = tutorial_isolation.run_isolated(os.getpid, (), name=UNIT, src_file="", limit_s=HANG_S, method="spawn")
    assert ended.answered and ended.value != os.getpid()
    ended = _isolated(tmp_path, "import time\ntime.sleep(600)\n", limit_s=20, method="spawn")
    # (the line it names is checked with fork, which starts at once: a spawned
    # interpreter's start-up counts against the limit, and on a loaded machine
    # it may not reach line 2 within 20 s)
    assert ended.failure.startswith(f"{UNIT} ran past the per-tutorial limit of 20 s"), ended


def test_fork_only_where_it_is_safe(monkeypatch):
    import torch

    monkeypatch.delenv(tutorial_isolation.START_METHOD_ENV, raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert tutorial_isolation.start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a CUDA context would not survive a fork
    assert tutorial_isolation.start_method() == "spawn"
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert tutorial_isolation.start_method() == "spawn"
    monkeypatch.setenv(tutorial_isolation.START_METHOD_ENV, "fork")
    assert tutorial_isolation.start_method() == "fork"


def test_sys_exit_fails_the_page_naming_the_tutorial_and_its_line(tmp_path):
    ended = _isolated(tmp_path, "x = 1\nimport sys\nsys.exit(3)\n")
    assert ended.raised is None and ended.failure == (
        f"{UNIT} called sys.exit(3) (or raised SystemExit) at line 3: a tutorial must not end the build; "
        "raise an exception instead"), ended


def _page_begins(src_dir):
    """As in a tutorial's process before Sphinx-Gallery's first (empty) call."""
    tutorial_isolation._page.update(src_dir=str(src_dir), fname="unit.py")
    return tutorial_isolation.PeakMemory()(lambda: None)[0]


def _transient_peak(src_dir):
    import torch

    def transient():
        block = torch.ones(32 * 2**20 // 4)  # 32 MB, touched, freed before the block ends
        del block
        return "done"

    base = _page_begins(src_dir)
    mb, out = tutorial_isolation.PeakMemory()(transient)
    return base, mb, out


def test_memory_figure_is_the_peak_of_the_tutorials_own_process(tmp_path):
    # The system keeps the process's peak: a peak freed within the block
    # counts, with nothing sampled, and the build process's own earlier
    # peaks (this test process's) do not.
    ended = tutorial_isolation.run_isolated(_transient_peak, (tmp_path,), name=UNIT, src_file="", limit_s=HANG_S)
    base, mb, out = ended.value
    assert out == "done" and mb - base >= 30, (base, mb)


def test_memory_figure_works_without_proc(monkeypatch):
    # As on macOS: no /proc; nothing of ours may open it.
    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setattr(io, "open", no_proc)
    mb, out = tutorial_isolation.PeakMemory()(lambda: "done")
    assert out == "done" and mb > 0


@pytest.mark.parametrize("can_reset", [True, False], ids=["linux", "no-reset"])
def test_memory_stamp_says_what_the_figure_is(can_reset, monkeypatch, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CUDA figure needs no reset")
    if can_reset and not sys.platform.startswith("linux"):
        pytest.skip("only Linux can reset the peak")
    if not can_reset:  # as on macOS
        monkeypatch.setattr(tutorial_isolation, "CLEAR_REFS", str(tmp_path / "no_such_file"))
    memory = page_parts.describe_environment()["memory"]
    assert memory.startswith(page_parts.CPU_FIGURE) and "process that ran this page and nothing else" in memory
    assert ("lower bound" in memory) == (not can_reset), memory


def _startup_then_page(src_dir):
    import torch

    startup = torch.ones(64 * 2**20 // 4)  # 64 MB the start-up used and freed
    del startup
    base = _page_begins(src_dir)
    mb, _ = tutorial_isolation.PeakMemory()(lambda: torch.ones(24 * 2**20 // 4).sum())
    return mb - base, json.loads((src_dir / "auto_tutorials" / "unit.env.json").read_text()), torch.rand(1).item()


def test_a_fresh_peak_is_the_pages_own_and_the_page_begins_seeded_and_stamped(tmp_path):
    # What a spawned interpreter's start-up used must not hide the page's
    # figure: the reset starts the peak afresh. The same first call seeds
    # and writes the page's stamp.
    import torch

    grew, stamp, draw = tutorial_isolation.run_isolated(_startup_then_page, (tmp_path,), name=UNIT, src_file="",
                                                        limit_s=HANG_S).value
    assert grew >= 20, grew
    assert stamp["torch"] == torch.__version__ and stamp["memory"].startswith(page_parts.CPU_FIGURE), stamp
    torch.manual_seed(0)
    assert draw == torch.rand(1).item()


# --- the notebook's install cell --------------------------------------------

def _pip_arguments(cell: str, folder: Path) -> list[str]:
    """What the cell asks ``%pip install`` for, run in ``folder`` (as IPython
    runs it: the magic becomes a call of ``get_ipython().run_line_magic``)."""
    from IPython.core.inputtransformer2 import TransformerManager

    calls, namespace = [], {}

    class Shell:
        def run_line_magic(self, name, line):  # IPython expands {name} from the namespace first
            calls.append((name, line.format_map(namespace)))

    python = TransformerManager().transform_cell(cell)
    here = os.getcwd()
    os.chdir(folder)
    try:
        namespace["get_ipython"] = Shell
        exec(compile(python, "install_cell", "exec"), namespace)  # noqa: S102
    finally:
        os.chdir(here)
    assert [name for name, _ in calls] == ["pip"], calls
    return calls[0][1].split()


def test_install_cell_asks_pip_for_the_minimums_and_the_wheel_beside_it_else_the_sites(tmp_path):
    mins = dict(downloads.minimums(REPO / "requirements-minimum.txt"))
    assert mins["torch"] == "2.11.0"
    cell = downloads.install_cell(REPO / "requirements-minimum.txt", "a_page", "tk-1.0-py3-none-any.whl",
                                  "https://site/_downloads/x/tk-1.0-py3-none-any.whl")
    assert len(cell.splitlines()) <= 8, "the install cell fills the screen"
    # pip keeps an installed release that satisfies name>=minimum (a newer
    # PyTorch is not replaced) and installs only what is missing or older
    wanted = [f'"{name}>={version}"' for name, version in mins.items() if name != "transformers"]
    args = _pip_arguments(cell, tmp_path)
    assert args == ["install", "--quiet", *wanted, "https://site/_downloads/x/tk-1.0-py3-none-any.whl"], args
    (tmp_path / "tk-1.0-py3-none-any.whl").write_bytes(b"")  # the page's zip: the wheel beside it
    assert _pip_arguments(cell, tmp_path)[-1] == "tk-1.0-py3-none-any.whl"


def test_the_packages_dependencies_are_the_minimums():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    mins = dict(downloads.minimums(REPO / "requirements-minimum.txt"))
    assert "optional-dependencies" not in project, "the library draws nothing: it needs no extra"
    for requirement in project["dependencies"]:
        name, version = requirement.split(">=")
        assert mins.get(name) == version, f"pyproject.toml asks {requirement}, requirements-minimum.txt {mins}"


def test_the_wheel_installs_and_changes_with_the_toolkit(tmp_path):
    """The pages' download: the library and the site's machinery in one wheel
    (``pip install .`` installs the library alone: tests/test_library.py)."""
    site = tmp_path / "site"
    for package in PACKAGES:
        shutil.copytree(REPO / package, site / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", site)
    name, data = downloads.wheel_bytes(site)
    assert downloads.wheel_bytes(site) == (name, data), "not the same bytes for the same sources"
    assert re.fullmatch(r"ragged_toolkit-1\.0\.0\+[0-9a-f]{10}-py3-none-any\.whl", name), name
    (site / "ragged_toolkit" / "device.py").write_text((site / "ragged_toolkit" / "device.py").read_text() + "\n")
    assert downloads.wheel_bytes(site)[0] != name, "a changed toolkit keeps its version: pip would not update it"
    (tmp_path / name).write_bytes(data)
    target = tmp_path / "installed"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--target", str(target), str(tmp_path / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    installed = {p.relative_to(target).as_posix() for p in target.rglob("*.py")}
    assert installed == {p.relative_to(REPO).as_posix() for package in PACKAGES
                         for p in (REPO / package).rglob("*.py")}
    metadata = next(target.glob("*.dist-info")).joinpath("METADATA").read_text()
    assert "Requires-Dist: torch>=2.11.0" in metadata, metadata


def test_minimums_agree_with_the_pins():
    pins = check_versions.pins()
    for name, minimum in downloads.minimums(REPO / "requirements-minimum.txt"):
        v = lambda s: tuple(int(x) for x in s.split("+")[0].split(".")[:3])  # noqa: E731
        assert v(pins[name]) >= v(minimum), f"{name}: pinned {pins[name]} is older than {minimum}"


# --- check-versions -----------------------------------------------------------

def test_check_versions_hashes_sources_as_sphinx_gallery_does(tmp_path):
    from sphinx_gallery.utils import get_md5sum

    src = tmp_path / "page.py"
    src.write_bytes(b"print(1)\r\nprint(2)\r\n")
    assert check_versions.md5_text(src) == get_md5sum(src, mode="t")


def test_version_matrix_is_oldest_pinned_newest_exactly():
    m = check_versions.matrix()
    oldest = dict(downloads.minimums(REPO / "requirements-minimum.txt"))["torch"]
    assert m == [oldest, check_versions.pins()["torch"], check_versions.NEWEST_TORCH]
    assert all(len(v.split(".")) == 3 for v in m)


def test_check_versions_cli_prints_the_matrix_and_merges_records(tmp_path, capsys):
    assert check_versions.main(["matrix"]) == 0
    assert json.loads(capsys.readouterr().out) == check_versions.matrix()
    record = tmp_path / "checked.json"
    record.write_text(json.dumps({"checked": {"2.13.0": {"pages": {"p": {"result": "failed"}}}}}))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"checked": {"2.13.0": {"pages": {"p": {"result": "passed"}}}}}))
    b.write_text(json.dumps({"checked": {"2.9.1": {"pages": {}}, "2.15.0": {"pages": {}}}}))
    assert check_versions.main(["merge", str(a), str(b), "--record", str(record)]) == 0
    merged = json.loads(record.read_text())["checked"]
    assert list(merged) == ["2.9.1", "2.13.0", "2.15.0"]  # by version, not as text
    assert merged["2.13.0"]["pages"]["p"]["result"] == "passed"  # the newer record wins


def test_a_run_of_some_pages_keeps_the_other_pages_of_the_same_environment():
    env = {"torch": "2.13.0", "numpy": "2.4.6", "matplotlib": "3.11.2", "python": "3.11.7", "quick": True}
    old = {"checked": {"2.13.0": {**env, "pages": {"p": {"md5": "a"}, "q": {"md5": "b"}}}}}
    some = {"checked": {"2.13.0": {**env, "date": "later", "pages": {"q": {"md5": "c"}}}}}
    merged = check_versions.merge_records(old, some)["checked"]["2.13.0"]
    assert merged["pages"] == {"p": {"md5": "a"}, "q": {"md5": "c"}} and merged["date"] == "later"
    other = {"checked": {"2.13.0": {**env, "numpy": "2.5.0", "pages": {"q": {"md5": "d"}}}}}
    assert check_versions.merge_records(old, other)["checked"]["2.13.0"]["pages"] == {"q": {"md5": "d"}}


@pytest.fixture
def one_env(monkeypatch, tmp_path):
    # This environment stands in for one of the matrix.
    monkeypatch.setattr(check_versions, "environment", lambda version, root: Path(sys.executable))
    return tmp_path


def test_check_versions_fails_on_a_deprecation_the_page_triggers(one_env):
    page = one_env / "deprecated.py"
    page.write_text("import warnings\nwarnings.warn('old api', DeprecationWarning)\nprint('ok')\n")
    fine = one_env / "fine.py"
    fine.write_text("import warnings\nwarnings.warn('a user note', UserWarning)\nprint('ok')\n")
    broken = one_env / "broken.py"
    broken.write_text("raise SystemExit(2)\n")
    rec = check_versions.check("x", [page, fine, broken], one_env)
    assert rec["pages"]["fine"]["result"] == "passed"
    assert rec["pages"]["deprecated"]["result"] == "failed"
    assert "DeprecationWarning" in rec["pages"]["deprecated"]["problems"][0]
    assert rec["pages"]["broken"]["result"] == "failed"


def test_check_versions_records_but_passes_a_warning_raised_inside_a_library(one_env):
    # A library that warns from its own lines (not a deprecated call the page
    # makes, which would point at the page's line): recorded, not failing.
    lib = one_env / "venv" / "lib" / "python3" / "site-packages" / "somelib.py"  # as pip installs it
    lib.parent.mkdir(parents=True)
    lib.write_text("import warnings\n\ndef work():\n"
                   "    warnings.warn('inside the library', FutureWarning, stacklevel=1)\n")
    page = one_env / "uses_lib.py"
    page.write_text(f"import sys\nsys.path.insert(0, {str(lib.parent)!r})\nimport somelib\nsomelib.work()\n")
    rec = check_versions.check("x", [page], one_env)["pages"]["uses_lib"]
    assert rec["result"] == "passed", rec
    # Recorded from site-packages on: nothing that belongs to one machine.
    assert rec["library_warnings"] == ["FutureWarning at somelib.py:4: inside the library"]


def test_the_version_records_hold_no_machine_paths():
    text = (REPO / ".github" / "checked-versions.json").read_text()
    assert "site-packages" not in text and str(REPO) not in text
    assert not re.search(r"(^|[\s\"'])/[\w.-]+/", text), "an absolute path in the record"
    assert check_versions.portable(f"at {REPO}/tutorials/x.py:3 and C:\\env\\Lib\\site-packages\\torch\\a.py:1") \
        == "at tutorials/x.py:3 and torch\\a.py:1"


def test_check_versions_run_writes_the_record_and_fails_on_a_failed_page(one_env, monkeypatch):
    (one_env / "ok.py").write_text("print('ok')\n")
    (one_env / "bad.py").write_text("raise ValueError('bad page')\n")
    record = one_env / "record.json"
    monkeypatch.chdir(one_env)  # pages given relative to here, as on a command line
    assert check_versions.main(["--torch", "x", "--pages", "ok.py", "--record", str(record)]) == 0
    assert check_versions.main(["--torch", "x", "--pages", "ok.py", "bad.py", "--record", str(record)]) == 1
    (rec,) = json.loads(record.read_text())["checked"].values()
    assert rec["pages"]["ok"] == {**rec["pages"]["ok"], "result": "passed",
                                  "md5": check_versions.md5_text(one_env / "ok.py")}
    assert rec["pages"]["bad"]["result"] == "failed" and "bad page" in rec["pages"]["bad"]["problems"][0]


def test_check_versions_reuses_an_environment_only_with_the_same_pins(tmp_path, monkeypatch):
    made = []
    def venv(cmd, **kw):  # python -m venv --clear DIR
        made.append(cmd)
        Path(cmd[-1]).mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(check_versions.subprocess, "run", venv)
    monkeypatch.setattr(check_versions, "_pip", lambda python, *reqs: made.append(reqs))
    python = check_versions.environment("2.15.0", tmp_path)
    assert python == tmp_path / "torch-2.15.0" / "bin" / "python"
    assert "torch==2.15.0" in made[-1] and f"numpy=={check_versions.pins()['numpy']}" in made[-1]
    made.clear()
    check_versions.environment("2.15.0", tmp_path)
    assert made == [], "an environment with the same pins was made again"
    monkeypatch.setattr(check_versions, "pins", lambda: {"torch": "2.13.0", "numpy": "9.9.9", "matplotlib": "1"})
    check_versions.environment("2.15.0", tmp_path)
    assert made and "numpy==9.9.9" in made[-1], "a changed pin did not remake the environment"


def test_stamp_states_only_versions_checked_for_the_current_source(tmp_path):
    (tmp_path / "tutorials").mkdir()
    (tmp_path / ".github").mkdir()
    src = tmp_path / "tutorials" / "page.py"
    src.write_text("print(1)\n")
    md5 = check_versions.md5_text(src)
    record = {"checked": {
        "2.11.0": {"pages": {"page": {"md5": md5, "result": "passed"}}},
        "2.13.0+cpu": {"pages": {"page": {"md5": md5, "result": "failed"}}},
        "2.15.0": {"pages": {"page": {"md5": "an older version", "result": "passed"}}},
    }}
    (tmp_path / ".github" / "checked-versions.json").write_text(json.dumps(record))
    assert page_parts.checked_versions(tmp_path, "page") == ["2.11.0"]
    assert "PyTorch 2.11.0 (make check-versions)" in page_parts.stamp_text(tmp_path, "page")[-1]


# --- the browser tests on a machine without Chromium --------------------------

def test_browser_tests_can_be_deselected_without_chromium(tmp_path):
    # PATH without chromium/chromedriver: deselecting must not error, and
    # selecting them must fail with the install hint, before any build.
    env = {**os.environ, "PATH": str(tmp_path)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "tests" / "test_browser.py")]
    deselected = subprocess.run([*cmd, "-m", "not browser"], env=env, capture_output=True, text=True,
                                cwd=REPO / "tests", timeout=300)
    assert deselected.returncode == 5, deselected.stdout[-2000:]  # 5: every test deselected
    assert "error" not in deselected.stdout.lower(), deselected.stdout[-2000:]
    selected = subprocess.run([*cmd, "-x", "-k", "index.html"], env=env, capture_output=True, text=True,
                              cwd=REPO / "tests", timeout=300)
    assert selected.returncode == 1 and "chromium-driver" in selected.stdout, selected.stdout[-2000:]


# --- the downloads: rST in notebook cells, the toolkit carried -----------------

import re  # noqa: E402
import textwrap  # noqa: E402

LEFT_RST = re.compile(r"^\s*\.\. [\w:-]+::|:[\w:]+:`", re.M)
MODULE_TEXT = textwrap.dedent('''\
    """A toolkit stand-in."""
    import functools


    def plain(x):
        return x + 1


    @functools.lru_cache(maxsize=None)
    @functools.wraps(plain)
    def cached(x):
        return x * 2


    class Box:
        size = 3

        def area(self):
            return self.size ** 2
    ''')


def _md(rst: str) -> str:
    return downloads.rst_to_markdown(textwrap.dedent(rst), include=lambda path: MODULE_TEXT)


def test_markdown_of_a_grid_of_cards():
    md = _md("""\
        Intro.

        .. grid:: 2

            .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
               :class-card: card-prerequisites

               * one thing
                 on two lines
               * another

            .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
               :class-card: card-prerequisites

               * PyTorch

        After.
        """)
    assert md == ("Intro.\n\n**What you will learn**\n\n* one thing\n  on two lines\n* another\n\n"
                  "**Prerequisites**\n\n* PyTorch\n\nAfter.\n")


def test_markdown_drops_comments_and_names_what_it_cannot_convert():
    assert _md("Before.\n\n.. a comment\n   that goes on\n\n.. currentmodule:: math\n\nAfter.\n") == \
        "Before.\n\nAfter.\n"
    # No raw rST reaches a reader: anything the pages do not use fails, named.
    with pytest.raises(ValueError, match=r"'\.\. raw::' has no Markdown form .* sphinxext/rst_markdown\.py"):
        _md(".. raw:: html\n\n   <b>x</b>\n")
    with pytest.raises(ValueError, match=r"'\.\. list-table::' has no Markdown form"):
        _md("* item\n\n  .. list-table::\n\n     * - a\n")
    with pytest.raises(ValueError, match=r"the role :kbd: has no Markdown form"):
        _md("Press :kbd:`Ctrl`.\n")


def test_markdown_of_literalinclude_pyobject_with_decorators_and_methods():
    md = _md("""\
        .. literalinclude:: ../tutorials/ragged_toolkit.py
           :pyobject: cached

        .. literalinclude:: ../tutorials/ragged_toolkit.py
           :pyobject: Box.area
        """)
    assert md == ("```python\n@functools.lru_cache(maxsize=None)\n@functools.wraps(plain)\n"
                  "def cached(x):\n    return x * 2\n```\n\n"
                  "```python\ndef area(self):\n    return self.size ** 2\n```\n")
    with pytest.raises(LookupError, match="missing"):
        _md(".. literalinclude:: x.py\n   :pyobject: missing\n")


def test_markdown_of_a_glossary():
    md = _md("""\
        .. glossary::

           packed values
           values
              Every token, end to end, see :term:`offsets`.

              Still the definition.

           offsets
              Where sequences start.

        After.
        """)
    assert md == ("**packed values**, **values**\n\nEvery token, end to end, see *offsets*.\n\n"
                  "Still the definition.\n\n**offsets**\n\nWhere sequences start.\n\nAfter.\n")


def test_markdown_of_roles():
    md = _md(":term:`ragged batch`, :term:`batches <ragged batch>`, :ref:`the intro <sphx_glr_x.py>`, "
             ":ref:`label`, :doc:`the gallery <index>`, :doc:`../toolkit`, :octicon:`rocket`launch, "
             "`what Sphinx-Gallery makes of :ref: <sphx_glr_x.py>`, ``:term:`literal```.\n")
    assert md == ("*ragged batch*, *batches*, *the intro*, *label*, *the gallery*, *toolkit*, launch, "
                  "*what Sphinx-Gallery makes of :ref:*, ``:term:`literal```.\n")
    # with the published site known, they stay links to its pages
    site = {("ref", "lbl"): ("The section", "https://site/a.html#lbl"), ("doc", "page"): ("T", "https://site/p.html"),
            ("term", "offsets"): (None, "https://site/intro.html#term-offsets")}
    linked = downloads.rst_to_markdown(":ref:`x <lbl>`, :ref:`lbl`, :doc:`page`, :term:`offsets`, :doc:`gone`",
                                       links=lambda kind, target: site.get((kind, target), (None, None)))
    assert linked == ("[x](https://site/a.html#lbl), [The section](https://site/a.html#lbl), "
                      "[T](https://site/p.html), [offsets](https://site/intro.html#term-offsets), *gone*\n")


def test_markdown_leaves_code_alone_and_is_idempotent():
    rst = textwrap.dedent("""\
        Text with :term:`offsets`.

        ```python
        # .. note:: in code
        x = ":term:`kept`"
        ```

        ```
        .. raw:: html
        ```
        """)
    md = _md(rst)
    assert md.startswith("Text with *offsets*.\n\n```python\n# .. note:: in code\nx = \":term:`kept`\"\n```")
    assert "```\n.. raw:: html\n```" in md
    assert _md(md) == md


def _nb(*cells):
    return {"cells": [{"cell_type": kind, "metadata": {}, "source": [src],
                       **({"outputs": [], "execution_count": None} if kind == "code" else {})}
                      for kind, src in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 0}


def test_notebook_for_download_opens_with_the_title_then_installs_and_drops_empty_cells():
    nb = _nb(("markdown", "\n# Title\n\n.. a comment\n\n   <b>x</b>\n"), ("code", ""),
             ("markdown", "See :term:`offsets`.\n"), ("code", "from ragged_toolkit.batches import f\n"))
    install = downloads.INSTALL_HEAD + " ...\n%pip install x"
    out = downloads.notebook_for_download(nb, install)
    kinds = [(c["cell_type"], c["source"] if isinstance(c["source"], str) else "".join(c["source"]))
             for c in out["cells"]]
    assert kinds == [("markdown", "# Title\n"), ("code", install), ("markdown", "See *offsets*.\n"),
                     ("code", "from ragged_toolkit.batches import f\n")]
    assert downloads.notebook_for_download(out, install) == out
    assert nb["cells"][1]["source"] == [""], "the input notebook was changed"
    import nbformat
    nbformat.validate(nbformat.reads(downloads.dump_notebook(out), as_version=4))


SCRIPT = '''"""
A page
======
"""
from __future__ import annotations

# sphinx_gallery_tags = ["x"]

# %%
# Text.
import sys

from ragged_toolkit.pairs import Pair, fails

print(Pair(1, 2))
'''
CARRIED = {
    "ragged_toolkit/__init__.py": '"""The package: a backslash \\\\d+ and a dataclass below."""\n',
    "ragged_toolkit/pairs.py": '''"""Pairs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pair:
    a: int
    b: int


def fails():
    raise ValueError("from the toolkit\\n")
''',
}


def test_carry_toolkit_keeps_the_page_first_and_carries_the_modules_at_the_end():
    out = downloads.carry_toolkit(SCRIPT, CARRIED)
    assert downloads.carry_toolkit(out, CARRIED) == out, "not idempotent"
    lines = out.splitlines()
    assert lines[:11] == SCRIPT.splitlines()[:11], "the page's docstring and code come first"
    at = lines.index("from ragged_toolkit.pairs import Pair, fails")
    assert "\n".join(lines[at - 3:at]) == downloads.LOADER.rstrip("\n"), "the loader is not right before the import"
    assert out.index("\n" + downloads.BEGIN + "\n") > out.index("print(Pair(1, 2))") and out.rstrip().endswith(downloads.END)
    with pytest.raises(ValueError, match="cannot be carried"):  # the delimiter is not free
        downloads.source_literal("x = \'\'\'y\'\'\'\n")


def test_carried_toolkit_runs_alone_and_shows_its_lines_in_tracebacks(tmp_path):
    for bad in ("x = \'\'\'a\'\'\'\n", "x = 1\r\n", "s = \'a\'", "x = 1  # \\"):
        with pytest.raises(ValueError, match="cannot be carried"):
            downloads.source_literal(bad)
    script = tmp_path / "page.py"
    script.write_text(downloads.carry_toolkit(SCRIPT + "fails()\n", CARRIED))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.stdout == "Pair(a=1, b=2)\n", proc.stderr
    assert re.search(r'File ".*/ragged_toolkit/pairs.py", line 14, in fails', proc.stderr), proc.stderr
    assert 'raise ValueError("from the toolkit\\n")' in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.py"], "it wrote beside the script"
