"""The build machinery, on a small fixture site built with the real conf.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from pages import soup
from sitebuild import FIXTURES, REPO, build, make_site

sys.path.insert(0, str(REPO / "sphinxext"))
import gallery_helpers  # noqa: E402

TINY = sorted((FIXTURES / "tutorials").glob("*.py"))


def line_of(path, text):
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if text in ln)


def test_fixture_pages_built(fixture_site):
    for path in TINY:
        assert (fixture_site.html / "auto_tutorials" / f"{path.stem}.html").is_file()
    assert "successfully executed 2 out of 2 files" in fixture_site.log


def test_build_seeds_every_source_before_a_tutorial(fixture_site):
    text = soup(fixture_site.html / "auto_tutorials" / "tiny_plot.html").get_text(" ")
    torch.manual_seed(0)
    assert f"torch sum: {round(float(torch.randn(4).sum()), 6)}" in text
    assert f"numpy draw: {np.random.default_rng(0).integers(0, 100, size=3).tolist()}" in text


def test_math_is_served_locally(fixture_site):
    page = soup(fixture_site.html / "auto_tutorials" / "tiny_text.html")
    scripts = [s.get("src", "") for s in page.find_all("script")]
    assert any(s.split("?")[0].endswith("_static/mathjax/tex-svg.js") for s in scripts), scripts
    assert page.select(".math"), "the math role was not rendered as math"


def test_memory_figure_is_measured(fixture_site):
    text = soup(fixture_site.html / "auto_tutorials" / "tiny_plot.html").get_text(" ")
    mb = float(text.split("Estimated memory usage:")[1].split("MB")[0])
    assert mb >= 60, f"the page touched 64 MB but its memory figure says {mb} MB"


def test_a_tutorial_that_raises_fails_the_build_naming_file_and_line(tmp_path):
    bad = FIXTURES / "faults" / "raises.py"
    site = make_site(tmp_path / "site", tutorials=[TINY[1], bad])
    result = build(site)
    assert result.returncode != 0
    assert "raises.py" in result.log
    assert f"line {line_of(bad, 'raise RuntimeError')}" in result.log
    assert "planted failure in a tutorial" in result.log


def test_html_noplot_builds_without_executing(tmp_path):
    site = make_site(tmp_path / "site", tutorials=TINY)
    result = build(site, "-D", "plot_gallery=0")
    assert result.returncode == 0, result.log[-5000:]
    page = soup(site / "_build" / "html" / "auto_tutorials" / "tiny_plot.html")
    assert not page.select("div.sphx-glr-script-out"), "html-noplot rendered output blocks"
    assert "built without running its code" in page.select_one(".build-stamp").get_text()


def test_gallery_pattern_executes_only_matching(tmp_path):
    site = make_site(tmp_path / "site", tutorials=TINY)
    result = build(site, env={"GALLERY_PATTERN": "tiny_text"})
    assert result.returncode == 0, result.log[-5000:]
    assert "successfully executed 1 out of 1 file" in result.log


def _spell(site):
    return subprocess.run([sys.executable, "-m", "pyspelling", "-c", ".pyspelling.yml"],
                          cwd=site, capture_output=True, text=True)


def test_spell_gate_names_a_planted_misspelling(tmp_path):
    site = make_site(tmp_path / "site", tutorials=[TINY[0], FIXTURES / "faults" / "typo.py"])
    result = _spell(site)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "recieve" in out and "tutorials/typo.py" in out, out


def test_spell_gate_passes_on_the_repository():
    result = _spell(REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_landing_cards_cover_every_tutorial():
    rst = gallery_helpers.landing_cards_rst(REPO)
    for path in (REPO / "tutorials").glob("*.py"):
        assert f":link: auto_tutorials/{path.stem}\n" in rst


def test_card_info_rejects_a_tutorial_without_title(tmp_path):
    path = tmp_path / "untitled.py"
    path.write_text('"""\nJust text, no title.\n"""\nprint(1)\n')
    with pytest.raises(ValueError, match="title"):
        gallery_helpers.tutorial_card_info(path)


def test_landing_cards_follow_the_reading_order():
    rst = gallery_helpers.landing_cards_rst(REPO)
    stems = [line.split("auto_tutorials/")[1] for line in rst.splitlines() if ":link: " in line]
    listed = [s for s in gallery_helpers.READING_ORDER if s in stems]
    assert stems[: len(listed)] == listed
    assert set(stems) == {p.stem for p in (REPO / "tutorials").glob("*.py")}
