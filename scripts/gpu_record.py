"""The record of a GPU run for the site: ``python scripts/gpu_check.py record
OUTDIR`` (a run's folder, a ``.tgz`` of one, or a ``--bundle`` folder) copies
a run's summary, the key lines of each page and its figures into
``gpu-results/`` (``--into``). The site's page "GPU results" shows that record
(``sphinxext/gpu_results.py``), and the next plan of ``scripts/gpu_check.py``
expects its durations.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLE_ARCHIVE = "gpu-check.tgz"  # under --bundle: the run without its compile cache; summary.json beside it
RESULTS = ROOT / "gpu-results"  # where `record` writes; sphinxext/gpu_results.py reads it (RESULTS_DIR)
RECORD_FILE = "summary.json"

def record(out: Path, into: Path, commit: str | None = None, allow_cpu: bool = False) -> Path:
    """Copy a run's summary, each page's key lines and the figures of its
    best run (full size where it passed, else quick mode) from ``out`` into
    ``into``, replacing the record there. ``out``: a run's ``--out`` folder,
    its :data:`BUNDLE_ARCHIVE`, or the ``--bundle`` folder that holds one.
    Returns the record's path."""
    out = Path(out)
    if out.is_dir() and (out / BUNDLE_ARCHIVE).is_file():
        out = out / BUNDLE_ARCHIVE
    if out.is_file():
        with tempfile.TemporaryDirectory() as unpacked:
            with tarfile.open(out, "r:gz") as tar:
                tar.extractall(unpacked, filter="data")
            return record(Path(unpacked), into, commit, allow_cpu)
    summary = json.loads((out / "summary.json").read_text())
    env = summary.get("environment") or {}
    if not env.get("cuda_available") and not allow_cpu:
        raise SystemExit(f"error: {out} is a run without a CUDA GPU (--allow-cpu): it is not recorded")
    commit = commit or summary.get("commit")
    if not commit:
        raise SystemExit(f"error: {out}/summary.json names no commit (git was not there): "
                         "say which with --commit SHA")
    pages: dict[str, dict] = {}
    for entry in summary["pages"]:
        page = pages.setdefault(entry["page"], {"md5": entry.get("md5"), "runs": []})
        run = {k: entry[k] for k in ("mode", "status", "seconds", "limit_s", "reason", "skipped") if k in entry}
        page["runs"].append({**run, "peak_mib": entry.get("peak_mib"), "key_lines": entry.get("key_lines", []),
                             "records": entry.get("records", [])})
    figures_dir = into / "figures"
    if figures_dir.exists():
        shutil.rmtree(figures_dir)
    for stem, page in pages.items():
        ran = {e["mode"]: e for e in summary["pages"] if e["page"] == stem and e.get("figures") is not None}
        best = next((ran[m] for m in ("full", "quick") if m in ran and ran[m]["status"] == "pass"),
                    next(iter(ran.values()), None))
        page["figures"], page["figures_from"] = [], best["mode"] if best else None
        for name in (best or {}).get("figures", []):
            target = figures_dir / stem / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out / best["folder"] / name, target)
            page["figures"].append(target.relative_to(into).as_posix())
    pre = summary.get("preflight") or {}
    rec = {"about": "A GPU run of the pages as plain scripts (scripts/gpu_check.py), recorded with "
                    "`python scripts/gpu_check.py record OUTDIR`; the page gpu_results shows it, apart from the "
                    "figures the site's own build measured.",
           "commit": commit, "commit_dirty": bool(summary.get("commit_dirty")),
           "date": summary["started"][:10], "started": summary["started"],
           "device": env.get("device") or "CPU", "versions": {k: env.get(k) for k in (
               "torch", "cuda", "cudnn", "triton", "transformers", "numpy", "matplotlib", "python")},
           "limit_s": summary.get("limit_s"), "seconds": summary.get("seconds"), "totals": summary.get("totals"),
           "preflight": {"status": pre.get("status"), "seconds": pre.get("seconds"), "lines": pre.get("lines", [])}
           if pre else None,
           "pages": pages}
    into.mkdir(parents=True, exist_ok=True)
    (into / RECORD_FILE).write_text(json.dumps(rec, indent=1) + "\n")
    return into / RECORD_FILE


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py record", description="record a GPU run for the site's page 'GPU results'")
    ap.add_argument("outdir", type=Path,
                    help=f"the --out folder of a run, its {BUNDLE_ARCHIVE}, or the --bundle folder holding it")
    ap.add_argument("--into", type=Path, default=RESULTS, help="the record's folder (default gpu-results/)")
    ap.add_argument("--commit", help="the commit the run was at, where its summary names none")
    ap.add_argument("--allow-cpu", action="store_true", help="record a CPU run (tests only)")
    args = ap.parse_args(argv)
    path = record(args.outdir, args.into, args.commit, args.allow_cpu)
    print(f"recorded {args.outdir} into {path}")
    return 0
