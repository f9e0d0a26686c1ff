"""Split the tutorial build across CI runners, and merge the pieces back.

The published site is built on GPU runners in parallel. Three commands:

``plan``
    Assign every tutorial to one of N shards, longest first, each to the shard
    that would finish earliest (the LPT rule), using the durations recorded by
    the last build. Tutorials marked as needing a GPU only go to GPU shards.
    Prints JSON for a GitHub Actions matrix.

``record``
    Update the durations file from a build's Sphinx-Gallery JUnit report (or
    from the run times cached in its gallery folder).

``merge``
    Combine the ``auto_tutorials/`` folders of shard builds: from each shard,
    the files of the tutorials it executed. Building the site over the merged
    folder then re-executes nothing (Sphinx-Gallery's MD5 cache) and yields one
    site with every page's own figures.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sphinxext"))
from gallery_layout import GALLERY_SRC, tutorial_files  # noqa: E402

DEFAULT_SECONDS = 120.0  # a tutorial never timed before


def load_durations(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data.get("tutorials", {})


def plan(stems: list[str], durations: dict[str, dict], shards: int,
         gpu_shards: int | None = None) -> list[dict]:
    """LPT assignment of tutorials to shards.

    ``gpu_shards``: how many of the shards (the first ones) run on GPU
    machines; default all. A tutorial with ``needs_gpu`` goes only there.
    """
    if shards < 1:
        raise ValueError("need at least one shard")
    gpu_shards = shards if gpu_shards is None else gpu_shards
    if not 0 <= gpu_shards <= shards:
        raise ValueError(f"gpu_shards must be between 0 and {shards}")
    known = [d["seconds"] for d in durations.values() if "seconds" in d]
    fallback = max(known) if known else DEFAULT_SECONDS

    def seconds(stem):
        return float(durations.get(stem, {}).get("seconds", fallback))

    def needs_gpu(stem):
        return bool(durations.get(stem, {}).get("needs_gpu", False))

    if gpu_shards == 0 and any(needs_gpu(s) for s in stems):
        missing = [s for s in stems if needs_gpu(s)]
        raise ValueError(f"tutorials {missing} need a GPU but no shard has one")

    result = [{"index": i, "runner": "gpu" if i < gpu_shards else "cpu",
               "tutorials": [], "seconds": 0.0} for i in range(shards)]
    # Longest first (ties by name, so a plan is reproducible), each to the
    # eligible shard with the least work so far (ties to the lowest index).
    for stem in sorted(stems, key=lambda s: (-seconds(s), s)):
        eligible = result[:gpu_shards] if needs_gpu(stem) else result
        shard = min(eligible, key=lambda sh: (sh["seconds"], sh["index"]))
        shard["tutorials"].append(stem)
        shard["seconds"] = round(shard["seconds"] + seconds(stem), 1)
    # A shard with nothing to run is left out: its build would execute
    # nothing, which the validator fails ("matched no tutorial").
    result = [shard for shard in result if shard["tutorials"]]
    for shard in result:
        shard["tutorials"].sort()
        shard["pattern"] = pattern_for(shard["tutorials"])
    return result


def pattern_for(stems: list[str]) -> str:
    """The GALLERY_PATTERN (a regular expression) that selects these files."""
    if not stems:
        raise ValueError("a pattern for no tutorial")
    return r"/(" + "|".join(re.escape(s) for s in stems) + r")\.py$"


def measured_seconds(source: Path) -> dict[str, float]:
    """Per-tutorial run times from a JUnit report, or from a gallery folder's
    cached costs (``<stem>.cost.json``, kept across no-change rebuilds)."""
    if source.is_dir():
        return {p.name[: -len(".cost.json")]: float(json.loads(p.read_text())["time"])
                for p in sorted(source.glob("*.cost.json"))}
    return {Path(c.get("file") or c.get("name")).stem: float(c.get("time"))
            for c in ET.parse(source).iter("testcase")}


def record(source: Path, durations_path: Path, needs_gpu: list[str]) -> dict:
    data = {"tutorials": load_durations(durations_path)}
    for stem, seconds in measured_seconds(source).items():
        if seconds <= 0:
            raise ValueError(f"{source}: {stem} has no run time; was it executed?")
        entry = data["tutorials"].setdefault(stem, {})
        entry["seconds"] = round(seconds, 1)
    for stem in needs_gpu:
        data["tutorials"].setdefault(stem, {})["needs_gpu"] = True
    data["tutorials"] = dict(sorted(data["tutorials"].items()))
    durations_path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def merge(shard_dirs: list[Path], plan_data: list[dict], out: Path) -> list[str]:
    """Copy each shard's executed tutorials from ``<shard>/auto_tutorials``."""
    if len(shard_dirs) != len(plan_data):
        raise ValueError(f"{len(shard_dirs)} shard folders for a plan of {len(plan_data)} shards")
    merged = []
    for shard_dir, shard in zip(shard_dirs, plan_data):
        for stem in shard["tutorials"]:
            files = tutorial_files(shard_dir, stem)
            if not any(p.name == f"{stem}.py.md5" for p in files):
                raise ValueError(f"shard {shard['index']} ({shard_dir}) did not execute {stem}")
            for p in files:
                dest = out / p.relative_to(shard_dir)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, dest)
            merged.append(stem)
    return sorted(merged)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--shards", type=int, required=True)
    p.add_argument("--gpu-shards", type=int)
    p.add_argument("--durations", type=Path, default=Path(".github/tutorial-durations.json"))
    p.add_argument("--tutorials", type=Path, default=Path(GALLERY_SRC))
    r = sub.add_parser("record")
    r.add_argument("source", type=Path, help="a JUnit report, or a gallery folder (auto_tutorials)")
    r.add_argument("--durations", type=Path, default=Path(".github/tutorial-durations.json"))
    r.add_argument("--needs-gpu", nargs="*", default=[])
    m = sub.add_parser("merge")
    m.add_argument("--plan", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("shard_dirs", type=Path, nargs="+")
    args = ap.parse_args(argv)

    if args.cmd == "plan":
        stems = sorted(p.stem for p in args.tutorials.glob("*.py"))
        if not stems:
            ap.error(f"no tutorials in {args.tutorials}")
        print(json.dumps(plan(stems, load_durations(args.durations), args.shards, args.gpu_shards)))
    elif args.cmd == "record":
        record(args.source, args.durations, args.needs_gpu)
    else:
        merged = merge(args.shard_dirs, json.loads(args.plan.read_text()), args.out)
        print(f"merged {len(merged)} tutorials: {', '.join(merged)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
