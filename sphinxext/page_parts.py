"""What the build adds to the pages, and what it takes out: the landing
cards (from what Sphinx-Gallery itself reads of each tutorial, written before
it runs anything, so bad metadata fails in seconds, named); "How this page
was built" (:func:`record_environment`, in the tutorial's process); "Download
the toolkit", "Run in Google Colab" and "View source on GitHub" beside the
downloads and in the side bar; no empty code block, and no script from other
hosts on the computation-times page."""

from __future__ import annotations

import functools
import json
import os
import platform
import re
from pathlib import Path
from urllib.parse import quote

from docutils import nodes
from sphinx import addnodes
from sphinx.errors import ExtensionError

from downloads import wheel_path
from gpu_results import stamp_paragraph
from gallery_layout import (
    GALLERY_OUT, GALLERY_SRC, TRACKS, reading_order_key, track_of, tutorial_sources, tutorial_stem,
)

CARDS = Path("_generated") / "cards.rst"
CHECKED_VERSIONS = Path(".github") / "checked-versions.json"
NOTEBOOKS_BRANCH = "notebooks"
TOOLKIT_LABEL = "Download the toolkit"


# --- landing cards -------------------------------------------------------------------

def card_info(path: Path) -> dict:
    """Title, description and tags of one tutorial, as Sphinx-Gallery reads
    them; ExtensionError naming the file when it would reject it. Each
    source is read once per version (every page's reading order names
    every page)."""
    return dict(_card_info(str(path), Path(path).stat().st_mtime_ns))


@functools.lru_cache(maxsize=None)
def _card_info(path: str, mtime_ns: int) -> dict:
    path = Path(path)
    from sphinx_gallery import py_source_parser
    from sphinx_gallery.gen_rst import extract_intro_and_title

    try:
        file_conf, blocks = py_source_parser.split_code_and_text_blocks(str(path))
        intro, title = extract_intro_and_title(str(path), blocks[0].content)
    except (ExtensionError, SyntaxError, ValueError) as err:
        raise ExtensionError(f"{path}: Sphinx-Gallery cannot read this file: {err}") from None
    tags = file_conf.get("tags", [])
    if not (isinstance(tags, list) and all(isinstance(t, str) and t.strip() for t in tags)):
        raise ExtensionError(f"{path}: sphinx_gallery_tags must be a list of words, got {tags!r}")
    thumb = file_conf.get("thumbnail_number", 1)
    if isinstance(thumb, bool) or not isinstance(thumb, int):
        raise ExtensionError(f"{path}: sphinx_gallery_thumbnail_number must be a whole number, got {thumb!r}")
    return {"stem": path.stem, "title": title, "description": intro, "tags": tags}


def tracks_of(src_dir: Path) -> dict[str, list[Path]]:
    """Track name -> its pages' sources in order (:data:`gallery_layout.TRACKS`);
    pages in no track last, under "More"."""
    sources = sorted(tutorial_sources(src_dir), key=lambda p: reading_order_key(p.stem))
    out = {name: [p for p in sources if p.stem in stems] for name, stems in TRACKS.items()}
    out["More"] = [p for p in sources if track_of(p.stem) is None]
    return {name: paths for name, paths in out.items() if paths}


def cards_rst(src_dir: Path) -> str:
    tracks = tracks_of(src_dir)
    first = next(iter(tracks.values()))[0].stem
    out = [f"**Start here:** :doc:`/{GALLERY_OUT}/{first}`, then follow a track in order.", ""]
    for number, (name, paths) in enumerate(tracks.items(), 1):
        out += [f".. rubric:: {number}. {name}", ""] + _cards(paths, number)
    return "\n".join(out) + "\n"


def _cards(paths: list[Path], track: int) -> list[str]:
    out = [".. grid:: 1 2 2 3", "   :gutter: 3", ""]
    for place, path in enumerate(paths, 1):
        card, stem = card_info(path), path.stem
        out += [f"   .. grid-item-card:: {track}.{place} {card['title']}",
                f"      :link: {GALLERY_OUT}/{stem}",
                "      :link-type: doc",
                f"      :img-top: /{GALLERY_OUT}/images/thumb/sphx_glr_{stem}_thumb.png",
                f"      :img-alt: Thumbnail of {card['title']}",
                "      :class-card: tutorial-card", "",
                f"      {card['description']}", ""]
        if card["tags"]:
            out += ["      " + " ".join(f":bdg-link-secondary:`{tag} <{GALLERY_OUT}/index.html?sg-tags="
                                         f"{quote(tag)}>`" for tag in card["tags"]), ""]
    return out


def write_cards(app) -> None:
    target = Path(app.srcdir) / CARDS
    target.parent.mkdir(exist_ok=True)
    text = cards_rst(Path(app.srcdir))
    if not target.exists() or target.read_text() != text:
        target.write_text(text)


# --- the reading order on each page ------------------------------------------------

def _doc_link(docname: str, stem: str, text: str) -> addnodes.pending_xref:
    ref = addnodes.pending_xref("", refdomain="std", reftype="doc", reftarget=f"/{GALLERY_OUT}/{stem}",
                                refexplicit=True, refdoc=docname)
    ref += nodes.inline(text=text)
    return ref


def reading_order(src_dir: Path, docname: str, stem: str) -> tuple[nodes.paragraph, nodes.admonition]:
    """What a tutorial's page shows of the reading order: a line under its
    title (its track and place) and, at its end, every track with this page
    marked and the next page of its track."""
    tracks = tracks_of(src_dir)
    track, paths = next((n, ps) for n, ps in tracks.items() if stem in [p.stem for p in ps])
    place = [p.stem for p in paths].index(stem)
    where = nodes.paragraph(classes=["reading-place"])
    where += nodes.Text(f"Track {list(tracks).index(track) + 1}, {track}: page {place + 1} of "
                        f"{len(paths)}. The reading order is at the end of the page.")
    box = nodes.admonition(classes=["reading-order"])
    box += nodes.title(text="Reading order")
    if place + 1 < len(paths):
        after = paths[place + 1].stem
        line = nodes.paragraph(classes=["next-in-track"])
        line += [nodes.Text("Next in this track: "), _doc_link(docname, after, card_info(paths[place + 1])["title"])]
        box += line
    for number, (name, members) in enumerate(tracks.items(), 1):
        box += nodes.paragraph(text=f"{number}. {name}")
        items = nodes.enumerated_list()
        for path in members:
            item, para = nodes.list_item(), nodes.paragraph()
            title = card_info(path)["title"]
            if path.stem == stem:
                para += [nodes.strong(text=title), nodes.Text(" (this page)")]
                item["classes"].append("this-page")
            else:
                para += _doc_link(docname, path.stem, title)
            item += para
            items += item
        box += items
    return where, box


# --- the build stamp ---------------------------------------------------------------

def stamp_path(src_dir: str | Path, fname: str) -> Path:
    return Path(src_dir) / GALLERY_OUT / (Path(fname).stem + ".env.json")


CPU_FIGURE = ("peak resident memory (RSS) of the process that ran this page and nothing else, "
              "above what it held when the page's code began")
CUDA_FIGURE = ("peak CUDA memory allocated (torch.cuda.max_memory_allocated) by the process that "
               "ran this page and nothing else")
LOWER_BOUND = ", a lower bound (the process's start-up may have used more before the page began)"


def describe_environment() -> dict:
    import torch

    from tutorial_isolation import CLEAR_REFS

    info = {"torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info.update(device=torch.cuda.get_device_name(0), memory=CUDA_FIGURE)
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        info.update(device=f"CPU, {cores} cores",
                    memory=CPU_FIGURE + ("" if os.access(CLEAR_REFS, os.W_OK) else LOWER_BOUND))
    info["compile_cache"] = (
        "this build's own torch.compile cache, empty when the build began, shared by its pages "
        "(compiled kernels only), in a process that ran nothing else"
        if os.environ.get("TUTORIALS_COMPILE_CACHE") == "build" else
        f"the torch.compile cache in {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'its default place')}")
    return info


def figures_path(src_dir: str | Path, fname: str) -> Path:
    """Where a page's figure records go (``ragged_site.records``): beside its
    output, one JSON object per figure it printed."""
    return Path(src_dir) / GALLERY_OUT / (Path(fname).stem + ".figures.jsonl")


def start_figure_records(src_dir: str | Path, fname: str) -> None:
    """In the tutorial's process, before its code: its figure records start
    empty, in :func:`figures_path`, named by ``$RAGGED_SITE_FIGURES``."""
    path = figures_path(src_dir, fname)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.environ["RAGGED_SITE_FIGURES"] = str(path)  # ragged_site.records.FIGURES_ENV


def record_environment(src_dir: str | Path, fname: str) -> None:
    path = stamp_path(src_dir, fname)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(describe_environment(), indent=1, sort_keys=True) + "\n")


def checked_versions(src_dir: Path, stem: str) -> list[str]:
    """Releases under which this page's current source passed check-versions."""
    record, source = src_dir / CHECKED_VERSIONS, src_dir / GALLERY_SRC / f"{stem}.py"
    if not record.exists() or not source.exists():
        return []
    from sphinx_gallery.utils import get_md5sum

    md5 = get_md5sum(source, mode="t")
    return [version for version, rec in json.loads(record.read_text()).get("checked", {}).items()
            if (page := rec.get("pages", {}).get(stem, {})).get("result") == "passed" and page.get("md5") == md5]


def stamp_text(src_dir: Path, stem: str) -> list[str]:
    path = stamp_path(src_dir, stem + ".py")
    if not path.exists():
        lines = ["This page was built without running its code, so it shows no figures."]
    else:
        info = json.loads(path.read_text())
        lines = [f"The figures on this page were produced while the site was built, with PyTorch "
                 f"{info['torch']} on {info['device']} (Python {info['python']}), with "
                 f"{info.get('compile_cache', 'the default torch.compile cache')}. The memory figure at "
                 f"the end is the {info['memory']}."]
    versions = checked_versions(src_dir, stem)
    if versions:
        listed = ", ".join(versions[:-1]) + " and " + versions[-1] if len(versions) > 1 else versions[0]
        lines.append(f"This version of the page was also run, in quick mode, with PyTorch {listed} "
                     "(make check-versions).")
    else:
        lines.append("This version of the page has not been run with other PyTorch releases yet "
                     "(make check-versions).")
    return lines


# --- links ---------------------------------------------------------------------------

def links(config, stem: str) -> dict[str, tuple[str, str]]:
    """Key -> (label, URL) for one tutorial."""
    repo, branch = config.tutorials_github_repo, config.tutorials_github_branch
    return {"colab": ("Run in Google Colab",
                      f"https://colab.research.google.com/github/{repo}/blob/{NOTEBOOKS_BRANCH}/{stem}.ipynb"),
            "github": ("View source on GitHub", f"https://github.com/{repo}/blob/{branch}/{GALLERY_SRC}/{stem}.py")}


def _box(key: str, child) -> nodes.container:
    box, para = nodes.container(classes=["sphx-glr-download", f"sphx-glr-download-{key}"]), nodes.paragraph()
    para += child
    box += para
    return box


def decorate_page(app, doctree) -> None:
    """``doctree-read``: no empty code block; on a tutorial's page the stamp
    before the download footer, the toolkit after the page's own .py, Colab
    and GitHub at the end."""
    docname, src_dir = app.env.docname, Path(app.srcdir)
    if docname.startswith(GALLERY_OUT + "/"):
        for block in list(doctree.findall(nodes.literal_block)):
            if not block.astext().strip():
                block.parent.remove(block)
    stem = tutorial_stem(docname)
    if stem is None:
        return
    for dep in (stamp_path(src_dir, stem + ".py"), src_dir / CHECKED_VERSIONS):  # re-read when they change
        if dep.exists():
            app.env.note_dependency(str(dep))
    note = nodes.admonition(classes=["build-stamp"])
    note += nodes.title(text="How this page was built")
    note += [nodes.paragraph(text=line) for line in stamp_text(src_dir, stem)]
    note += stamp_paragraph(app.env, docname, stem)  # where its GPU figures are (sphinxext/gpu_results.py)
    where, order = reading_order(src_dir, docname, stem)
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is not None:
        title = next((i for i, c in enumerate(section.children) if isinstance(c, nodes.title)), -1)
        section.insert(title + 1, where)
    footer = next((n for n in doctree.findall(nodes.container) if "sphx-glr-footer" in n["classes"]), None)
    if footer is None:
        (section if section is not None else doctree).extend([order, note])
        return
    footer.parent.insert(footer.parent.index(footer), order)
    footer.parent.insert(footer.parent.index(footer), note)
    wheel = wheel_path(src_dir)  # the toolkit's wheel (sphinxext/downloads.py)
    if wheel is not None:
        target = f"/{wheel.as_posix()}"  # registered as Sphinx's :download: role registers a file
        ref = addnodes.download_reference("", "", refdoc=docname, reftarget=target, refexplicit=True,
                                          classes=["tutorial-toolkit-link"])
        ref += nodes.literal("", f"{TOOLKIT_LABEL} (wheel)", classes=["xref", "download"])
        rel, _ = app.env.relfn2path(target, docname)
        app.env.note_dependency(rel)  # a new toolkit is a new wheel: the page is read again
        ref["filename"] = app.env.dlfiles.add_file(docname, rel).as_posix()
        python = [i for i, c in enumerate(footer.children) if "sphx-glr-download-python" in c.get("classes", [])]
        footer.insert(python[0] + 1 if python else len(footer.children), _box("toolkit", ref))
    for key, (label, url) in links(app.config, stem).items():
        footer += _box(key, nodes.reference("", label, refuri=url, classes=[f"tutorial-{key}-link"]))


def page_context(app, pagename, templatename, context, doctree) -> None:
    """``html-page-context``: the same links for the side-bar component."""
    stem = tutorial_stem(pagename)
    if stem is not None and doctree is not None:
        context["tutorial_links"] = links(app.config, stem)
        wheel = wheel_path(Path(app.srcdir))
        if wheel is not None and wheel in app.env.dlfiles:  # as decorate_page registered it
            context["tutorial_toolkit"] = {"link": f"_downloads/{app.env.dlfiles[wheel][1]}",
                                           "label": TOOLKIT_LABEL, "title": wheel.name}


_REMOTE_RAW = re.compile(r"^(?P<i>[ ]*)\.\. raw:: html\n(?:\n|(?P=i)[ ]+.*\n)*", re.M)


def strip_remote_assets(app, docname, source) -> None:
    """``source-read``: the computation-times pages keep their plain table."""
    if docname.endswith("sg_execution_times"):
        source[0] = _REMOTE_RAW.sub(lambda m: m.group(0) if "https://" not in m.group(0) else "", source[0])


def setup(app):
    app.add_config_value("tutorials_github_repo", "", "html", types=[str])
    app.add_config_value("tutorials_github_branch", "main", "html", types=[str])
    app.connect("builder-inited", write_cards, priority=400)  # Sphinx-Gallery runs at 500
    app.connect("doctree-read", decorate_page)
    app.connect("html-page-context", page_context)
    app.connect("source-read", strip_remote_assets)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
