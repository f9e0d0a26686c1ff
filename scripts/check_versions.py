"""Run every tutorial under the PyTorch releases the site supports.

``make check-versions`` runs this. For each release of the matrix (the oldest
supported, from ``requirements-minimum.txt``; the pinned one, from
``requirements-tutorials.txt``; the newest, ``NEWEST_TORCH`` below) it makes a
virtual environment of its own with that ``torch`` pinned exactly (numpy and
matplotlib at the build's pins), then runs every page in ``tutorials/`` as a
plain script in quick mode (``TUTORIALS_QUICK=1``, ``MPLBACKEND=agg``).

A page fails on any error, and on any ``DeprecationWarning`` or
``FutureWarning`` raised from the page's own lines (a deprecated call the
page makes) that importing torch, numpy and matplotlib alone does not raise.
Such warnings raised inside a library, from the library's own calls, are
listed in the record as ``library_warnings`` but fail nothing: the page
cannot change them. What was really checked (the
versions installed, and for each page the hash of the source that passed) is
written to ``.github/checked-versions.json``; the build states it on each
page, for the page's current source only.

The pages that import ``transformers`` are also run under the oldest
``transformers`` they support (the ``# page:`` lines of
``requirements-minimum.txt``), the pinned one and the newest
(``NEWEST_TRANSFORMERS``), each with the pinned PyTorch in an environment of
its own, and recorded in ``.github/checked-transformers.json`` the same way.

Commands::

    check_versions.py [run] [--torch 2.15.0 ...] [--transformers 5.24.0 ...]
                                                   check, record, exit 1 on a failure
                                                   (with neither option: both matrices)
    check_versions.py matrix                       the PyTorch releases, as JSON (for CI)
    check_versions.py transformers-matrix          the transformers releases, as JSON
    check_versions.py merge A.json B.json ...      combine records from CI jobs

Only the standard library is used, so this runs under any Python 3.11+.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sphinxext"))
from gallery_layout import tutorial_sources  # noqa: E402
from downloads import minimums  # noqa: E402 - the reader of requirements-minimum.txt

# The newest PyTorch release the pages are checked with. Raise it when a new
# release is out.
NEWEST_TORCH = "2.15.0"
RECORD = REPO / ".github" / "checked-versions.json"
# The newest transformers release the pages that import it are checked with.
# (5.25.0 needs kernels>=0.19.1, which the package index this was last run
# against did not have: raise it where it installs.)
NEWEST_TRANSFORMERS = "5.24.0"
# The transformers release of the lent GPU machine (its Python has no other):
# checked too, so that what the GPU check runs there is a release on record.
GPU_MACHINE_TRANSFORMERS = "5.17.0"
TRANSFORMERS_RECORD = REPO / ".github" / "checked-transformers.json"
ABOUT = {
    RECORD.name: "Written by `make check-versions` (scripts/check_versions.py): the PyTorch "
                 "releases every page was really run under, in quick mode. Commit it.",
    TRANSFORMERS_RECORD.name: "Written by `make check-versions` (scripts/check_versions.py): the "
                              "transformers releases the pages that import it were really run "
                              "under, in quick mode, with the pinned PyTorch. Commit it.",
}
VENVS = REPO / ".venvs"
PAGE_TIMEOUT_S = 900
WATCHED = ("DeprecationWarning", "FutureWarning")


def pins() -> dict[str, str]:
    """The build's exact pins (``requirements-tutorials.txt``)."""
    out = {}
    for line in (REPO / "requirements-tutorials.txt").read_text().splitlines():
        m = re.match(r"^\s*([\w.-]+)==([\w.+]+)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def matrix() -> list[str]:
    """Oldest supported, pinned, newest: each an exact version."""
    oldest = dict(minimums(REPO / "requirements-minimum.txt"))["torch"]
    pinned = pins()["torch"]
    out = []
    for v in (oldest, pinned, NEWEST_TORCH):
        if v not in out:
            out.append(v)
    return out


def imports_transformers(page: Path) -> bool:
    """Whether a tutorial imports ``transformers`` anywhere."""
    for node in ast.walk(ast.parse(page.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "transformers" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
            return True
    return False


def transformers_matrix(pages: list[Path] | None = None) -> list[str]:
    """Oldest supported (the highest minimum among the pages that import it),
    the GPU machine's, pinned, newest: each an exact version. Empty where no
    page imports it."""
    pages = [p for p in (pages or tutorial_sources(REPO)) if imports_transformers(p)]
    if not pages:
        return []
    found = []
    for page in pages:
        mins = dict(minimums(REPO / "requirements-minimum.txt", page.stem))
        if "transformers" not in mins:
            raise ValueError(f"{page.name} imports transformers, but requirements-minimum.txt has no "
                             f"'transformers>=...  # page: {page.stem}' line")
        found.append(mins["transformers"])
    oldest = max(found, key=lambda v: [int(x) for x in re.findall(r"\d+", v)])
    out = []
    for v in (oldest, GPU_MACHINE_TRANSFORMERS, pins()["transformers"], NEWEST_TRANSFORMERS):
        if v not in out:
            out.append(v)
    return out


def md5_text(path: Path) -> str:
    """The hash Sphinx-Gallery keeps for a source (text mode, so line
    endings do not matter)."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return hashlib.md5(f.read().encode("utf-8", errors="surrogateescape")).hexdigest()


# --- the environments -----------------------------------------------------

def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args]
    if subprocess.run(cmd).returncode == 0:
        return
    # A pip configuration may cap versions (a constraint file, a local index);
    # the release asked for is still on the registry: try once without it.
    print(f"  pip failed with this machine's pip configuration; retrying with PIP_CONFIG_FILE={os.devnull}",
          flush=True)
    if subprocess.run(cmd, env={**os.environ, "PIP_CONFIG_FILE": os.devnull}).returncode != 0:
        raise RuntimeError(f"could not install {' '.join(args)}")


def environment(torch_version: str, root: Path, extra: dict[str, str] | None = None) -> Path:
    """A virtual environment with exactly this torch (and the releases in
    ``extra``, beside the other pins); reused when it has them."""
    extra = {k: v for k, v in (extra or {}).items() if pins().get(k) != v}
    venv = root / "-".join([f"torch-{torch_version}", *(f"{k}-{v}" for k, v in sorted(extra.items()))])
    python = venv / "bin" / "python"
    stamp = venv / ".check-versions.json"
    want = {"torch": torch_version, **{k: v for k, v in pins().items() if k != "torch"}, **extra}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return python
    print(f"creating {venv} with " + ", ".join(f"{k}=={v}" for k, v in want.items()), flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    _pip(python, *(f"{k}=={v}" for k, v in want.items()))
    stamp.write_text(json.dumps(want))
    return python


def installed(python: Path) -> dict[str, str]:
    code = ("import json, platform, importlib.metadata as m\n"
            "def v(name):\n"
            "    try:\n        return m.version(name)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            "found = {n: v(n) for n in ('torch', 'numpy', 'matplotlib', 'transformers')}\n"
            "print(json.dumps({**{n: x for n, x in found.items() if x}, "
            "'python': platform.python_version()}))")
    return json.loads(subprocess.run([str(python), "-c", code], check=True,
                                     capture_output=True, text=True).stdout)


# --- one page ---------------------------------------------------------------

# Runs inside the environment under test: the page as ``__main__``, every
# deprecation and future warning recorded once per place it was raised.
RUNNER = r"""
import json, runpy, sys, warnings
out, page, baseline_only = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
seen = []
_show = warnings.showwarning
def show(message, category, filename, lineno, file=None, line=None):
    if category.__name__ in ("DeprecationWarning", "FutureWarning") or issubclass(
            category, (DeprecationWarning, FutureWarning)):
        seen.append({"category": category.__name__, "message": str(message).splitlines()[0][:300],
                     "where": f"{filename}:{lineno}"})
    _show(message, category, filename, lineno, file, line)
warnings.showwarning = show
warnings.simplefilter("default", DeprecationWarning)
warnings.simplefilter("default", FutureWarning)
try:
    if baseline_only:
        import torch, numpy, matplotlib.pyplot  # noqa: F401
    else:
        runpy.run_path(page, run_name="__main__")
finally:
    with open(out, "w") as f:
        json.dump(seen, f)
"""


def run_page(python: Path, page: Path | None, workdir: Path) -> tuple[int, str, list[dict]]:
    out = workdir / "warnings.json"
    # the pages import the toolkit module that lies beside them
    env = {**os.environ, "TUTORIALS_QUICK": "1", "MPLBACKEND": "agg", "PYTHONWARNINGS": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [str(python), "-c", RUNNER, str(out), str(page or ""), "0" if page else "1"],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    caught = json.loads(out.read_text()) if out.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, caught


# A path inside a virtual environment's site-packages, up to and including it.
_ENV_PATH = re.compile(r"(?:[A-Za-z]:)?[^\s\"'():]*[\\/](?:site|dist)-packages[\\/]")


def portable(text: str) -> str:
    """``text`` without what belongs to one machine: a path inside an
    environment's ``site-packages`` from there on, a path in this checkout
    relative to it."""
    return _ENV_PATH.sub("", text).replace(str(REPO) + os.sep, "")


def _key(w: dict) -> tuple[str, str]:
    # Compare by category and message: line numbers move between releases.
    return w["category"], w["message"]


def check(torch_version: str, pages: list[Path], root: Path, extra: dict[str, str] | None = None) -> dict:
    """Every page under one release (and ``extra``); returns that release's record."""
    python = environment(torch_version, root, extra) if extra else environment(torch_version, root)
    versions = installed(python)
    record = {**versions, "date": dt.date.today().isoformat(), "quick": True, "pages": {}}
    with tempfile.TemporaryDirectory() as tmp:
        _, _, baseline = run_page(python, None, Path(tmp))
    known = {_key(w) for w in baseline}
    for page in pages:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                rc, log, caught = run_page(python, page, Path(tmp))
            except subprocess.TimeoutExpired:
                rc, log, caught = -1, f"timed out after {PAGE_TIMEOUT_S} s", []
        fresh = [w for w in caught if _key(w) not in known]
        new = [w for w in fresh if w["where"].rsplit(":", 1)[0] == str(page)]
        elsewhere = sorted({portable(f"{w['category']} at {w['where']}: {w['message']}")
                            for w in fresh if w not in new})
        problems = []
        if rc != 0:
            tail = "\n".join(log.strip().splitlines()[-15:])
            problems.append(f"exited with status {rc}:\n{tail}")
        problems += [f"{w['category']} at {w['where']}: {w['message']}" for w in new]
        problems = [portable(p) for p in problems]
        seconds = time.perf_counter() - start
        record["pages"][page.stem] = {
            "md5": md5_text(page),
            "result": "failed" if problems else "passed",
            "seconds": round(seconds, 1),
            **({"problems": problems} if problems else {}),
            **({"library_warnings": elsewhere} if elsewhere else {}),
        }
        status = "ok" if not problems else "FAILED"
        under = f"torch {versions['torch']}" + "".join(f", {k} {versions.get(k)}" for k in extra or {})
        print(f"  {under}: {page.name}: {status} ({seconds:.0f} s)", flush=True)
        for p in problems:
            print("    " + p.replace("\n", "\n    "), flush=True)
        for w in elsewhere:
            print(f"    (raised inside a library, not failing the page) {w}", flush=True)
    return record


#: What makes two runs of a version the same environment.
ENVIRONMENT = ("torch", "numpy", "matplotlib", "transformers", "python", "quick")


def merge_records(existing: dict, *records: dict, about: str = ABOUT[RECORD.name]) -> dict:
    """Later records replace earlier ones for the same version. Where both
    ran in the same environment (:data:`ENVIRONMENT`), a later run of some
    pages (``--pages``) replaces only those pages' entries; the other pages
    keep theirs, each with the hash of the source that passed."""
    checked = dict(existing.get("checked", {}))
    for rec in records:
        for version, entry in rec.get("checked", {}).items():
            before = checked.get(version)
            same = before is not None and all(before.get(k) == entry.get(k) for k in ENVIRONMENT)
            if same:
                entry = {**entry, "pages": {**before.get("pages", {}), **entry.get("pages", {})}}
            checked[version] = entry
    return {
        "about": about,
        "checked": dict(sorted(checked.items(), key=lambda kv: [int(x) for x in re.findall(r"\d+", kv[0])])),
    }


def load_record(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("run", help="check (the default command)")
    for p in (ap, r):
        p.add_argument("--torch", nargs="+", help="releases to check (default: the matrix)")
        p.add_argument("--transformers", nargs="+",
                       help="transformers releases to check the pages that import it with, under the "
                            "pinned torch (default: the transformers matrix, when --torch is not given)")
        p.add_argument("--transformers-record", type=Path, default=TRANSFORMERS_RECORD)
        p.add_argument("--pages", nargs="+", type=Path, help="tutorial files (default: tutorials/*.py)")
        p.add_argument("--venvs", type=Path, default=VENVS, help="where the environments live")
        p.add_argument("--record", type=Path, default=RECORD)
    sub.add_parser("matrix", help="print the releases as a JSON list")
    sub.add_parser("transformers-matrix", help="print the transformers releases as a JSON list")
    m = sub.add_parser("merge", help="merge records into --record")
    m.add_argument("records", type=Path, nargs="+")
    m.add_argument("--record", type=Path, default=RECORD)
    args = ap.parse_args(argv)

    if args.cmd == "matrix":
        print(json.dumps(matrix()))
        return 0
    if args.cmd == "transformers-matrix":
        print(json.dumps(transformers_matrix()))
        return 0
    if args.cmd == "merge":
        merged = merge_records(load_record(args.record), *(load_record(p) for p in args.records),
                               about=ABOUT.get(args.record.name, ABOUT[RECORD.name]))
        args.record.write_text(json.dumps(merged, indent=1) + "\n")
        return 0

    # Absolute: each page runs in a temporary folder of its own.
    pages = sorted(p.resolve() for p in args.pages or tutorial_sources(REPO))
    if not pages:
        ap.error("no tutorials to check")
    args.venvs.mkdir(parents=True, exist_ok=True)
    torch_versions = args.torch or ([] if args.transformers else matrix())
    hf_pages = [p for p in pages if imports_transformers(p)]
    hf_versions = args.transformers or ([] if args.torch or not hf_pages else transformers_matrix(hf_pages))
    failed = []
    if torch_versions:
        results = {}
        for version in torch_versions:
            print(f"PyTorch {version}", flush=True)
            rec = check(version, pages, args.venvs)
            results[rec["torch"]] = rec
            failed += [f"{stem} under torch {rec['torch']}" for stem, p in rec["pages"].items()
                       if p["result"] != "passed"]
        args.record.parent.mkdir(parents=True, exist_ok=True)
        merged = merge_records(load_record(args.record), {"checked": results})
        args.record.write_text(json.dumps(merged, indent=1) + "\n")
        print(f"recorded in {args.record}; pages run under torch " + ", ".join(sorted(results)))
    if hf_versions:
        if not hf_pages:
            ap.error("no page imports transformers")
        results = {}
        for version in hf_versions:
            print(f"transformers {version} (torch {pins()['torch']})", flush=True)
            rec = check(pins()["torch"], hf_pages, args.venvs, {"transformers": version})
            results[rec.get("transformers", version)] = rec
            failed += [f"{stem} under transformers {rec.get('transformers', version)}"
                       for stem, p in rec["pages"].items() if p["result"] != "passed"]
        args.transformers_record.parent.mkdir(parents=True, exist_ok=True)
        merged = merge_records(load_record(args.transformers_record), {"checked": results},
                               about=ABOUT[TRANSFORMERS_RECORD.name])
        args.transformers_record.write_text(json.dumps(merged, indent=1) + "\n")
        print(f"recorded in {args.transformers_record}; "
              + ", ".join(p.stem for p in hf_pages) + " run under transformers " + ", ".join(results))
    if failed:
        print("error: failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    print("check-versions: every page passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
