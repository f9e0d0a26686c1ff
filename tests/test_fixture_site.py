"""The build machinery, on small fixture sites built with the real conf.py."""

from __future__ import annotations

import html
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pages import printed, soup
from sitebuild import FIXTURES, REPO, STEMS, TOOLKIT, build, error_lines, line_of, make_site, reached

sys.path.insert(0, str(REPO / "sphinxext"))
import gallery_layout  # noqa: E402
import page_parts  # noqa: E402
from sphinx.errors import ExtensionError  # noqa: E402

TINY = sorted((FIXTURES / "tutorials").glob("*.py"))
STYLES = sorted((FIXTURES / "styles").glob("*.py"))
FAULTS = FIXTURES / "faults"


def page(build_result, stem):
    return soup(build_result.html / "auto_tutorials" / f"{stem}.html")


def test_fixture_pages_built(fixture_site):
    for path in TINY:
        assert (fixture_site.html / "auto_tutorials" / f"{path.stem}.html").is_file()
    assert "successfully executed 2 out of 2 files" in fixture_site.log


def test_build_seeds_every_global_generator_before_a_tutorial(fixture_site):
    # tiny_plot draws from torch's, numpy's and random's global generators
    # without seeding them: only the build's seeding makes these values.
    text = page(fixture_site, "tiny_plot").get_text(" ")
    torch.manual_seed(0)
    assert f"torch sum: {round(float(torch.randn(4).sum()), 6)}" in text
    np.random.seed(0)
    assert f"numpy draw: {np.random.randint(0, 100, size=3).tolist()}" in text
    random.seed(0)
    assert f"random draw: {random.randint(0, 100)}" in text


def test_math_is_served_locally(fixture_site):
    p = page(fixture_site, "tiny_text")
    scripts = [s.get("src", "") for s in p.find_all("script")]
    assert any(s.split("?")[0].endswith("_static/mathjax/tex-svg.js") for s in scripts), scripts
    assert p.select(".math"), "the math role was not rendered as math"


def _memory_figure(site, stem):
    text = (site / "auto_tutorials" / f"{stem}.rst").read_text()
    return float(re.search(r"Estimated memory usage:\*\*\s*([\d.]+) MB", text).group(1))


def test_memory_figure_is_measured(fixture_site):
    mb = _memory_figure(fixture_site.src, "tiny_plot")
    assert mb >= 60, f"the page holds 64 MB but its memory figure says {mb} MB"


def test_cpu_memory_figure_does_not_depend_on_the_page_before(tmp_path):
    # b_holder holds one 24 MB tensor. a_churn, built before it, freed 28 MB
    # that the C allocator keeps in its heap: without handing freed memory
    # back to the system before each page, the holder reuses it and reports
    # about 0 MB.
    if torch.cuda.is_available():
        pytest.skip("the CPU memory figure is only used without CUDA")
    holder = FIXTURES / "memory" / "b_holder.py"
    after = make_site(tmp_path / "after", tutorials=[FIXTURES / "memory" / "a_churn.py", holder])
    result = build(after)
    assert result.returncode == 0, result.log[-3000:]
    mb = _memory_figure(after, "b_holder")
    assert mb >= 20, f"a page holding 24 MB reports {mb} MB after a page that freed memory"


def test_a_tutorial_that_raises_fails_the_build_naming_file_and_line(tmp_path):
    bad = FAULTS / "raises.py"
    site = make_site(tmp_path / "site", tutorials=[TINY[1], bad])
    result = build(site)
    assert result.returncode != 0
    assert error_lines(result.log, "tutorials/raises.py", "failed leaving traceback"), result.log[-3000:]
    assert f'raises.py", line {line_of(bad, "raise RuntimeError")}' in result.log
    assert "RuntimeError: planted failure in a tutorial" in result.log


def test_html_noplot_builds_without_executing(tmp_path):
    site = make_site(tmp_path / "site", tutorials=TINY)
    result = build(site, "-D", "plot_gallery=0")
    assert result.returncode == 0, result.log[-5000:]
    p = soup(site / "_build" / "html" / "auto_tutorials" / "tiny_plot.html")
    assert not p.select("div.sphx-glr-script-out"), "html-noplot rendered output blocks"
    assert "built without running its code" in p.select_one(".build-stamp").get_text()


def test_gallery_pattern_runs_a_subset_and_the_others_keep_their_cache(tmp_path):
    site = make_site(tmp_path / "site", tutorials=TINY)
    assert build(site).returncode == 0
    (site / "tutorials" / "tiny_text.py").write_text(
        (site / "tutorials" / "tiny_text.py").read_text() + "\nprint('edited')\n")
    result = build(site, env={"GALLERY_PATTERN": "tiny_text"})
    assert result.returncode == 0, result.log[-5000:]
    assert "successfully executed 1 out of 1 file" in result.log
    p = soup(site / "_build" / "html" / "auto_tutorials" / "tiny_plot.html")
    assert p.select("div.sphx-glr-script-out"), "the page outside the pattern lost its cached output"
    assert "PyTorch" in p.select_one(".build-stamp").get_text()


def _spell(site):
    return subprocess.run([sys.executable, "-m", "pyspelling", "-c", ".pyspelling.yml"],
                          cwd=site, capture_output=True, text=True)


def test_spell_gate_names_a_planted_misspelling(tmp_path):
    site = make_site(tmp_path / "site", tutorials=[TINY[0], FAULTS / "typo.py"])
    result = _spell(site)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "recieve" in out and "tutorials/typo.py" in out, out


def test_spell_gate_passes_on_the_repository():
    result = _spell(REPO)
    assert result.returncode == 0, result.stdout + result.stderr


# --- any valid Sphinx-Gallery tutorial ---------------------------------------

@pytest.fixture(scope="module")
def styles_site(tmp_path_factory):
    """Tutorials written as other galleries write them: other underlines, an
    overlined title, a label and a directive before the title, no tags, no
    thumbnail, a note before the first cell, tags inside a later cell."""
    site = make_site(tmp_path_factory.mktemp("styles") / "site", tutorials=STYLES + TINY)
    result = build(site)
    assert result.returncode == 0, result.log[-5000:]
    return result


def test_tutorials_in_other_galleries_styles_build(styles_site):
    cards = {}
    for card in soup(styles_site.html / "index.html").select(".tutorial-card"):
        stem = card.select_one("a.sd-stretched-link")["href"].split("/")[-1].removesuffix(".html")
        cards[stem] = card
    assert set(cards) == {p.stem for p in STYLES + TINY}
    for path in STYLES + TINY:
        p = page(styles_site, path.stem)
        title = p.find("h1").get_text(strip=True).rstrip("#")
        # The card carries the title Sphinx-Gallery rendered on the page,
        # after its place in the reading order ("1.2 ").
        shown = cards[path.stem].select_one(".sd-card-title").get_text(strip=True)
        assert re.fullmatch(r"\d+\.\d+ ", shown[: -len(title)]) and shown.endswith(title), (shown, title)
        # The environment stamp sits after the page's content, right before
        # its download links, whatever the page's style.
        stamp = p.select_one(".build-stamp")
        assert stamp is not None and stamp.find_next("div", class_="sphx-glr-footer") is not None
        assert not stamp.find_all_next("div", class_="sphx-glr-script-out"), "output after the stamp"


def test_card_text_is_sphinx_gallerys_own(styles_site):
    # The gallery index Sphinx-Gallery writes shows each example's title and
    # intro in its thumbnail; the landing card shows the same.
    index = (styles_site.src / "auto_tutorials" / "index.rst").read_text()
    tooltips = {html.unescape(t) for t in re.findall(r'tooltip="([^"]*)"', index)}
    for path in STYLES + TINY:
        card = page_parts.card_info(path)
        assert f":doc:`/auto_tutorials/{path.stem}`" in index
        assert card["description"] in tooltips, (card["description"], tooltips)
        assert f"<div class=\"sphx-glr-thumbnail-title\">{card['title']}</div>" in index


def test_tags_come_from_sphinx_gallery_and_link_to_its_tag_filter(styles_site):
    card = next(c for c in soup(styles_site.html / "index.html").select(".tutorial-card")
                if "overline_title" in c.select_one("a.sd-stretched-link")["href"])
    hrefs = [a["href"] for a in card.select("a.sd-badge")]
    assert hrefs == ["auto_tutorials/index.html?sg-tags=styles", "auto_tutorials/index.html?sg-tags=plots"]
    # Sphinx-Gallery's own tag line on the page.
    assert "Tags: styles, plots" in page(styles_site, "overline_title").get_text(" ")


def test_no_page_has_an_empty_code_block(styles_site):
    for path in STYLES + TINY:
        blocks = page(styles_site, path.stem).select("div.highlight pre")
        assert blocks or path.stem in {"note_first"}, path.stem
        assert all(b.get_text().strip() for b in blocks), f"{path.stem}: an empty code block"


@pytest.mark.parametrize("bad", ["bad_tags.py", "no_docstring.py"])
def test_bad_metadata_fails_in_seconds_before_anything_runs(tmp_path, bad):
    # slow.py (a 600 s sleep) comes first in Sphinx-Gallery's order, the bad
    # file last: the build must reject the bad file without starting slow.py.
    site = make_site(tmp_path / "site", tutorials=[FAULTS / "slow.py", FAULTS / bad])
    (site / "tutorials" / bad).rename(site / "tutorials" / f"zz_{bad}")
    result = build(site, env={"TUTORIAL_TIME_LIMIT_S": "30"})  # so that a regression fails in a minute
    assert result.returncode != 0
    assert error_lines(result.log, f"tutorials/zz_{bad}"), result.log[-3000:]
    assert not reached(result.log, "slow"), f"slow.py was started before zz_{bad} was rejected"
    assert result.seconds < 300, f"the build took {result.seconds:.0f} s to reject {bad}"


def test_card_info_reads_what_sphinx_gallery_reads():
    info = page_parts.card_info(FIXTURES / "styles" / "preamble_title.py")
    assert info["title"] == "A page with a label before its title"
    assert info["description"].startswith("A reference label and a directive")
    assert info["tags"] == []
    with pytest.raises(ExtensionError, match="no_docstring.py"):
        page_parts.card_info(FAULTS / "no_docstring.py")


def test_landing_cards_cover_every_tutorial_in_reading_order():
    rst = page_parts.cards_rst(REPO)
    stems = [line.split("auto_tutorials/")[1] for line in rst.splitlines() if ":link: " in line]
    assert set(stems) == set(STEMS)
    listed = [s for s in gallery_layout.READING_ORDER if s in stems]
    assert stems[: len(listed)] == listed


def test_reading_order_ignores_missing_and_appends_unlisted(monkeypatch):
    monkeypatch.setattr(gallery_layout, "READING_ORDER", ["second", "first", "listed_but_missing"])
    key = gallery_layout.reading_order_key
    assert sorted(["zeta", "first", "alpha", "second"], key=key) == ["second", "first", "alpha", "zeta"]


# --- what makes a page run again ---------------------------------------------

MODULE_PAGES = sorted((FIXTURES / "modules").glob("*.py"))  # uses_batches, uses_measure


def test_a_changed_module_runs_again_only_the_pages_that_import_it(tmp_path):
    """Each page's toolkit modules are read from its imports (and theirs): a
    change to ``clock`` runs the page that imports ``measure`` (the harness's
    ``measuring.timing``, which imports the library's ``clock``) and no other; a change to ``batches`` only its page; no change,
    nothing. A build that ran every page again fails this test."""
    site = make_site(tmp_path / "site", tutorials=[*MODULE_PAGES, FIXTURES / "tutorials" / "tiny_text.py"])
    assert build(site).returncode == 0
    again = build(site)
    assert again.returncode == 0 and "successfully executed 0 out of" in again.log, again.log[-3000:]
    for module, page in (("clock", "uses_measure"), ("batches", "uses_batches")):
        path = site / TOOLKIT / f"{module}.py"
        path.write_text(path.read_text() + "\n# changed\n")
        changed = build(site)
        assert changed.returncode == 0, changed.log[-3000:]
        assert "successfully executed 1 out of 1 file" in changed.log, changed.log[-3000:]
        ran = re.findall(r"gallery_layout: (.+) changed, (\w+)\.py runs again", changed.log)
        assert [r[1] for r in ran] == [page], ran
        assert f"ragged_toolkit.{module}" in ran[0][0], ran


# --- renamed and deleted tutorials ------------------------------------------

def test_a_renamed_tutorial_leaves_no_stale_page(tmp_path):
    site = make_site(tmp_path / "site", tutorials=TINY)
    assert build(site).returncode == 0
    old = site / "tutorials" / "tiny_plot.py"
    shutil.move(old, site / "tutorials" / "tiny_plot_renamed.py")
    result = build(site)
    assert result.returncode == 0, result.log[-5000:]
    gallery = site / "auto_tutorials"
    assert not list(gallery.glob("tiny_plot.*")), sorted(p.name for p in gallery.glob("tiny_plot.*"))
    assert not list(gallery.rglob("sphx_glr_tiny_plot_[0t]*")), "images of the old name remain"
    assert (gallery / "tiny_plot_renamed.rst").is_file()
    assert (gallery / "tiny_text.py.md5").is_file(), "a live tutorial's cache was removed"


# --- the build's own compile cache -------------------------------------------

def test_each_build_compiles_with_a_cache_of_its_own(tmp_path):
    # Two pages in each of two builds: one cache per build, empty when the
    # build began, shared by its pages; none left after the build.
    dirs = []
    for i in range(2):
        site = make_site(tmp_path / f"site{i}", tutorials=[TINY[1], FAULTS / "compile_cache.py"])
        shutil.copy2(FAULTS / "compile_cache.py", site / "tutorials" / "compile_cache_again.py")
        env = {"TORCHINDUCTOR_CACHE_DIR": "", "TRITON_CACHE_DIR": ""}
        result = build(site, env=env)
        assert result.returncode == 0, result.log[-3000:]
        for stem in ("compile_cache", "compile_cache_again"):
            html = soup(site / "_build" / "html" / "auto_tutorials" / f"{stem}.html")
            dirs.append(re.search(r"inductor cache: (\S+)", html.get_text(" ")).group(1))
            stamp = html.select_one(".build-stamp").get_text(" ")
            assert "this build's own torch.compile cache, empty when the build began" in stamp
    assert dirs[0] == dirs[1] and dirs[2] == dirs[3] and dirs[0] != dirs[2], dirs
    assert all("tutorials-compile-cache-" in d for d in dirs), dirs
    assert not any(Path(d).exists() for d in dirs), "a build left its compile cache behind"


# --- the GPU workflow's merge job -------------------------------------------

def test_a_build_over_an_executed_gallery_needs_no_torch(tmp_path, fixture_site):
    # What the merge job does: build over auto_tutorials/ that shards
    # executed, with only requirements-site.txt installed. Here torch (and
    # numpy) cannot be imported at all.
    site = make_site(tmp_path / "site", tutorials=TINY)
    shutil.copytree(fixture_site.src / "auto_tutorials", site / "auto_tutorials")
    blocker = tmp_path / "blocker"
    for name in ("torch", "numpy"):
        (blocker / name).mkdir(parents=True)
        (blocker / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed')\n")
    result = build(site, env={"PYTHONPATH": str(blocker)})
    assert result.returncode == 0, result.log[-5000:]
    assert "executed 0 out of" in result.log
    assert page(result, "tiny_plot").select("div.sphx-glr-script-out")
