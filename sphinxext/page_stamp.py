"""The "How this page was built" note at the end of each tutorial.

Before a tutorial runs, :func:`record_environment` writes
``auto_tutorials/<stem>.env.json``: the PyTorch, Python and device that
produce its figures, what the memory figure measures and which compile cache
the build used. When Sphinx reads the page, the note is inserted after the
page's content, before its download links, with the PyTorch releases that
``make check-versions`` really ran the page's current source under
(``.github/checked-versions.json``).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from docutils import nodes

from gallery_layout import GALLERY_OUT, GALLERY_SRC, tutorial_stem

STAMP_SUFFIX = ".env.json"
CHECKED_VERSIONS = Path(".github") / "checked-versions.json"


def stamp_path(src_dir: str | Path, fname: str) -> Path:
    return Path(src_dir) / GALLERY_OUT / (Path(fname).stem + STAMP_SUFFIX)


def describe_environment() -> dict:
    import torch

    import tutorial_memory

    info = {"torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["memory"] = tutorial_memory.CUDA_FIGURE
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        info["device"] = f"CPU, {cores} cores"
        info["memory"] = tutorial_memory.cpu_figure()
    cache = os.environ.get("TUTORIALS_COMPILE_CACHE")
    info["compile_cache"] = (
        "this build's own torch.compile cache, empty when the build began, shared by its pages "
        "(compiled kernels only), in a process that ran nothing else"
        if cache == "build" else
        f"the torch.compile cache in {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'its default place')}")
    return info


def record_environment(src_dir: str | Path, fname: str) -> None:
    path = stamp_path(src_dir, fname)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(describe_environment(), indent=1, sort_keys=True) + "\n")


def checked_versions(src_dir: Path, stem: str) -> list[str]:
    """Releases under which this page's current source passed check-versions."""
    record = src_dir / CHECKED_VERSIONS
    source = src_dir / GALLERY_SRC / f"{stem}.py"
    if not record.exists() or not source.exists():
        return []
    from sphinx_gallery.utils import get_md5sum

    md5 = get_md5sum(source, mode="t")
    found = []
    for version, rec in json.loads(record.read_text()).get("checked", {}).items():
        page = rec.get("pages", {}).get(stem, {})
        if page.get("result") == "passed" and page.get("md5") == md5:
            found.append(version)
    return found


def stamp_text(src_dir: Path, stem: str) -> list[str]:
    path = stamp_path(src_dir, stem + ".py")
    if not path.exists():
        lines = ["This page was built without running its code, so it shows no figures."]
    else:
        info = json.loads(path.read_text())
        lines = [
            f"The figures on this page were produced while the site was built, with "
            f"PyTorch {info['torch']} on {info['device']} (Python {info['python']}), "
            f"with {info.get('compile_cache', 'the default torch.compile cache')}. The memory "
            f"figure at the end is the {info['memory']}."]
    versions = checked_versions(src_dir, stem)
    if versions:
        listed = ", ".join(versions[:-1]) + " and " + versions[-1] if len(versions) > 1 else versions[0]
        lines.append(f"This version of the page was also run, in quick mode, with PyTorch "
                     f"{listed} (make check-versions).")
    else:
        lines.append("This version of the page has not been run with other PyTorch releases "
                     "yet (make check-versions).")
    return lines


def insert_stamp(app, doctree) -> None:
    """``doctree-read``: the note goes at the end of the page, after what the
    page teaches and before its download links."""
    stem = tutorial_stem(app.env.docname)
    if stem is None:
        return
    src_dir = Path(app.srcdir)
    # Re-read the page when what the note says changes.
    for dep in (stamp_path(src_dir, stem + ".py"), src_dir / CHECKED_VERSIONS):
        if dep.exists():
            app.env.note_dependency(str(dep))
    note = nodes.admonition(classes=["build-stamp"])
    note += nodes.title(text="How this page was built")
    for line in stamp_text(src_dir, stem):
        note += nodes.paragraph(text=line)
    footer = next((n for n in doctree.findall(nodes.container) if "sphx-glr-footer" in n["classes"]), None)
    if footer is not None:
        footer.parent.insert(footer.parent.index(footer), note)
    else:
        section = next(iter(doctree.findall(nodes.section)), None)
        (section if section is not None else doctree).append(note)


def setup(app):
    app.connect("doctree-read", insert_stamp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
