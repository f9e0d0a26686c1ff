"""The page "GPU results": a GPU run of the pages recorded in ``gpu-results/``
(``python scripts/gpu_check.py record OUTDIR``), apart from what the site's
own build measured. Written, before Sphinx reads anything, as
``gpu_results.rst`` in the site's folder (a generated file, as Sphinx-
Gallery's ``sg_execution_times.rst``); "No GPU run has been recorded yet."
until a run is recorded. Each tutorial's stamp links to it
(:func:`stamp_paragraph`, called by ``page_parts.decorate_page``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from docutils import nodes
from sphinx import addnodes

from gallery_layout import GALLERY_OUT, GALLERY_SRC, reading_order_key

RESULTS_DIR = "gpu-results"  # the record's folder in the site (scripts/gpu_check.py: RESULTS)
RECORD = Path(RESULTS_DIR) / "summary.json"
PAGE = "gpu_results"  # the generated page's name, in index.rst's toctree
LABEL = "gpu-results"  # the page's label; a tutorial's section is LABEL-<stem>
NONE_YET = "No GPU run has been recorded yet."


def source_md5(path: Path) -> str:
    """As Sphinx-Gallery and scripts/gpu_check.py hash a source."""
    return hashlib.md5(path.read_text(encoding="utf-8").encode("utf-8")).hexdigest()


def changed_since(record: dict, src_dir: Path, stem: str) -> bool:
    """Whether the page's source differs from the one the record ran."""
    source, md5 = Path(src_dir) / GALLERY_SRC / f"{stem}.py", record["pages"][stem].get("md5")
    return bool(md5) and source.exists() and source_md5(source) != md5


def load_record(src_dir: Path) -> dict | None:
    path = Path(src_dir) / RECORD
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _a(name: str) -> str:
    """"an NVIDIA H200", "a Tesla T4": the article as the name is read."""
    word = name.split()[0] if name.split() else name
    spelled = word.isupper() and len(word) <= 6  # an acronym is read letter by letter
    return "an" if (word[:1] in "AEFHILMNORSX" if spelled else word[:1].lower() in "aeiou") else "a"


def measured_on(record: dict) -> str:
    """"Measured on an NVIDIA H200 with PyTorch 2.11.0+cu130 at commit
    abc1234, 2026-12-04"."""
    commit = record["commit"][:7] + (" (with uncommitted changes)" if record.get("commit_dirty") else "")
    device = record["device"]
    return (f"Measured on {_a(device)} {device} with PyTorch {record['versions']['torch']} at commit {commit}, "
            f"{record['date']}")


def _heading(text: str, char: str) -> list[str]:
    return [text, char * len(text), ""]


def _code(lines: list[str]) -> list[str]:
    return [".. code-block:: text", ""] + [f"   {ln}" if ln.strip() else "" for ln in lines] + [""]


def _run_text(run: dict) -> str:
    mode = "Full size" if run["mode"] == "full" else "Quick mode"
    status = {"pass": "passed", "fail": "failed", "cut": "cut at the run's overall limit",
              "skip": f"skipped ({run.get('skipped', 'a package missing')})",
              "not run": f"not run ({run.get('reason', 'no time left')})"}.get(run["status"], run["status"])
    text = f"{mode}: {status}"
    if run["status"] in ("pass", "fail", "cut"):
        text += f" in {run['seconds']:.1f} s"
    peak = run.get("peak_mib") or {}
    if peak.get("cuda_mib") is not None:
        text += f", peak CUDA memory allocated {peak['cuda_mib']:.1f} MiB (the page's own process)"
    elif peak.get("rss_mib") is not None:
        text += f", peak resident memory {peak['rss_mib']:.1f} MiB (the page's own process)"
    if run["status"] == "fail" and run.get("reason"):
        text += f"; its last line: ``{run['reason'][:160]}``"
    return text + "."


def results_rst(src_dir: Path) -> str:
    """The page, from the record in ``src_dir`` (none: :data:`NONE_YET`)."""
    src_dir, record = Path(src_dir), load_record(src_dir)
    out = [f".. _{LABEL}:", ""] + _heading("GPU results", "=")
    if record is None:
        return "\n".join(out + [
            NONE_YET, "",
            "When one is, this page shows what it measured, page by page: the speedup, training and kernel "
            "lines each page printed, its peak memory and its figures, with the commit, date, device and "
            "versions they came from, apart from the figures on the tutorial pages, which the site's own "
            "build measured. ``scripts/gpu_check.py`` runs the pages on a GPU machine and records a run "
            "into ``gpu-results/`` (the README's section \"The GPU check\")."]) + "\n"
    versions = record["versions"]
    out += _heading(measured_on(record), "-")
    out += [".. admonition:: Not the figures on the tutorial pages", "   :class: gpu-results-note", "",
            "   These figures come from one run of the pages as plain scripts on a GPU machine "
            "(``scripts/gpu_check.py``), recorded in ``gpu-results/``. The tutorial pages show what the "
            "site's own build measured, on the device each page's stamp names; nothing here was measured "
            "by that build.", ""]
    out += ["Versions: " + ", ".join(f"{name} ``{versions[key]}``" for name, key in (
        ("PyTorch", "torch"), ("CUDA", "cuda"), ("cuDNN", "cudnn"), ("triton", "triton"),
        ("transformers", "transformers"), ("numpy", "numpy"), ("Python", "python")) if versions.get(key)) + ".",
        ""]
    if record.get("seconds") is not None:
        out += [f"The run took {record['seconds']:.0f} s of its {record['limit_s']:.0f} s limit.", ""]
    if record.get("preflight"):
        out += _heading("Preflight", "~") + _code(record["preflight"]["lines"])
    stems = sorted(record["pages"], key=reading_order_key)
    sources = {p.stem: p for p in sorted((src_dir / GALLERY_SRC).glob("*.py"))}
    for stem in stems:
        page = record["pages"][stem]
        out += [f".. _{LABEL}-{stem}:", ""] + _heading(f"``{stem}``", "~")
        if stem in sources:
            out += [f"The page: :doc:`/{GALLERY_OUT}/{stem}`.", ""]
            if changed_since(record, src_dir, stem):
                out += ["The page has changed since this run: these figures are from an earlier version of it.",
                        ""]
        else:
            out += ["This page is no longer on the site.", ""]
        out += [f"* {_run_text(run)}" for run in page["runs"]] + [""]
        shown = next((r for r in page["runs"] if r["mode"] == page.get("figures_from")), None) or \
            next((r for r in page["runs"] if r.get("key_lines")), None)
        if shown and shown.get("key_lines"):
            label = "full size" if shown["mode"] == "full" else "quick mode"
            out += [f"What it printed ({label}), the key lines:", ""] + _code(shown["key_lines"])
        for i, fig in enumerate(page.get("figures", []), 1):
            out += [f".. image:: /{RESULTS_DIR}/{fig}", f"   :alt: Figure {i} of {stem}, from the GPU run", ""]
    return "\n".join(out) + "\n"


def write_page(app) -> None:
    """``builder-inited``: (re)write the page; unchanged text leaves the file,
    so that Sphinx does not read it again."""
    target = Path(app.srcdir) / f"{PAGE}.rst"
    text = results_rst(Path(app.srcdir))
    if not target.exists() or target.read_text(encoding="utf-8") != text:
        target.write_text(text, encoding="utf-8")


def stamp_paragraph(env, docname: str, stem: str) -> nodes.paragraph:
    """The stamp's sentence on a tutorial page: where its GPU figures are,
    or that none are recorded, linked to the page either way."""
    src_dir = Path(env.srcdir)
    if (src_dir / RECORD).exists():
        env.note_dependency(str(src_dir / RECORD))  # a new record: the stamp is read again
    record = load_record(src_dir)
    page = (record or {}).get("pages", {}).get(stem)
    if page:
        earlier = " (an earlier version of this page)" if changed_since(record, src_dir, stem) else ""
        text = f"GPU figures for this page, apart from this build's: {measured_on(record)}{earlier}; see "
        target = f"{LABEL}-{stem}"
    else:
        text, target = "No GPU run of this page has been recorded yet: see ", LABEL
    ref = addnodes.pending_xref("", nodes.inline("", "GPU results", classes=["xref", "std", "std-ref"]),
                                refdomain="std", reftype="ref", reftarget=target, refexplicit=True,
                                refwarn=True, refdoc=docname)
    para = nodes.paragraph("", text, classes=["gpu-results-link"])
    para += ref
    para += nodes.Text(".")
    return para


def setup(app):
    app.connect("builder-inited", write_page)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
