"""Build a copy of the site (or a fixture site) in a temporary folder."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The real tutorials: the tests never depend on which ones there are.
sys.path.insert(0, str(REPO / "sphinxext"))
from gallery_layout import HARNESS, TOOLKIT, tutorial_sources  # noqa: E402

STEMS = [p.stem for p in tutorial_sources(REPO)]

# What a site needs besides its tutorials.
SITE_FILES = [
    "conf.py",
    "index.rst",
    "toolkit.rst",
    "requirements-tutorials.txt",
    "pyproject.toml",
    "requirements-minimum.txt",
    ".github/checked-versions.json",
    ".pyspelling.yml",
    "spelling_wordlist.txt",
]
SITE_DIRS = ["sphinxext", "_static", "_templates", TOOLKIT, HARNESS, "gpu-results"]  # the package the pages import; a GPU run


@dataclass
class Build:
    src: Path
    out: Path
    returncode: int
    log: str
    seconds: float  # wall-clock
    cpu_seconds: float  # of the build's processes: not stretched by a loaded or paused machine

    @property
    def html(self) -> Path:
        return self.out / "html"


def make_site(dst: Path, tutorials: list[Path] | None = None) -> Path:
    """A copy of the real site in ``dst``, with the given tutorial files
    (default: the real ones)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in SITE_FILES:
        if (REPO / name).exists():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dst / name)
    for name in SITE_DIRS:
        shutil.copytree(REPO / name, dst / name, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    tut = dst / "tutorials"
    tut.mkdir(exist_ok=True)
    shutil.copy2(REPO / "tutorials" / "GALLERY_HEADER.rst", tut)
    sources = tutorials if tutorials is not None else [REPO / "tutorials" / f"{stem}.py" for stem in STEMS]
    for path in sources:
        shutil.copy2(path, tut / path.name)
    return dst


def validate_site(src: Path, pattern: str = "") -> subprocess.CompletedProcess:
    """``scripts/validate_build.py`` on a built site, as ``make html`` runs it."""
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "validate_build.py"), str(src), "--pattern", pattern],
        capture_output=True, text=True)


def build(src: Path, *extra: str, env: dict | None = None, validate: bool = True) -> Build:
    """Run what ``make html`` runs: the strict sphinx-build, then (when the
    tutorials were executed) the check that each of them ran to the end."""
    out = src / "_build"
    cmd = [sys.executable, "-m", "sphinx", "-M", "html", str(src), str(out),
           "-W", "--keep-going", "-n", *extra]
    # A cache folder this process chose is not the build's: importing torch's
    # compiler here sets TORCHINDUCTOR_CACHE_DIR, which the build would take
    # as the reader's choice (what env passes still counts).
    inherited = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    full_env = {**inherited, "GALLERY_PATTERN": "", **(env or {})}
    start, cpu_start = time.perf_counter(), _children_cpu()
    proc = subprocess.run(cmd, cwd=src, env=full_env, capture_output=True, text=True)
    returncode, log = proc.returncode, proc.stdout + proc.stderr
    if validate and returncode == 0 and "plot_gallery=0" not in extra:
        check = validate_site(src, full_env["GALLERY_PATTERN"])
        returncode, log = check.returncode, log + check.stdout + check.stderr
    return Build(src, out, returncode, log, time.perf_counter() - start, _children_cpu() - cpu_start)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def line_of(path: Path, code: str) -> int:
    """The number of the first line of ``path`` that starts with ``code``
    (after its indentation)."""
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip().startswith(code))


def error_lines(log: str, *needles: str) -> list[str]:
    """Lines of a build log that hold every one of ``needles`` (a successful
    build's log names every tutorial too: look for the name and the error on
    one line)."""
    return [ln for ln in log.splitlines() if all(n in ln for n in needles)]


def reached(log: str, stem: str) -> bool:
    """Whether Sphinx-Gallery began to generate the page of ``stem`` (and to
    execute it, unless cached): its progress line,
    "generating gallery for auto_tutorials... [ 50%] stem.py"."""
    return bool(error_lines(log, "generating gallery for ", f" {stem}.py"))
