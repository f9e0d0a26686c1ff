"""Checks on the real site, built once per session from a clean copy."""

from __future__ import annotations

import ast
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest
import torch

from pages import download_links, external_resources, run_seconds, soup
from sitebuild import REPO, STEMS, build

sys.path.insert(0, str(REPO / "sphinxext"))
import notebook_cell  # noqa: E402

def test_there_are_tutorials():
    assert STEMS, "no tutorials in tutorials/"


@pytest.mark.parametrize("stem", STEMS)
def test_page_has_output_and_run_time(real_site, stem):
    page = soup(real_site.html / "auto_tutorials" / f"{stem}.html")
    outputs = page.select("div.sphx-glr-script-out")
    assert outputs, f"{stem}: no rendered output blocks"
    assert all(o.get_text(strip=True) for o in outputs), f"{stem}: an empty output block"
    assert run_seconds(page) > 0, f"{stem}: run time is zero, so its code did not run"


def test_junit_records_every_tutorial_as_passing(real_site):
    tree = ET.parse(real_site.html / "sphinx-gallery" / "junit-results.xml")
    cases = {Path(c.get("file") or c.get("name")).stem: c for c in tree.iter("testcase")}
    assert set(cases) == set(STEMS)
    for stem, case in cases.items():
        assert float(case.get("time")) > 0, f"{stem}: JUnit time is zero"
        assert not list(case), f"{stem}: JUnit records a failure or skip"


@pytest.mark.parametrize("stem", STEMS)
def test_downloads_exist_and_notebook_is_valid(real_site, stem):
    html = real_site.html / "auto_tutorials" / f"{stem}.html"
    links = download_links(soup(html))
    assert set(links) == {".py", ".ipynb"}, f"{stem}: download links {links}"
    for suffix, href in links.items():
        target = (html.parent / href).resolve()
        assert target.is_file(), f"{stem}: {href} does not exist"
        assert target.name == stem + suffix
    nb = nbformat.read((html.parent / links[".ipynb"]).resolve(), as_version=4)
    nbformat.validate(nb)
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    # Installs only what is missing or older than requirements-minimum.txt.
    assert first_code.source.strip() == notebook_cell.install_cell(REPO / "requirements-minimum.txt").strip()
    assert "==" not in first_code.source


def conf_value(name: str):
    """A literal that conf.py assigns to ``name`` (read, not run: running
    conf.py would set up a compile cache in this process)."""
    for node in ast.parse((REPO / "conf.py").read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"conf.py does not set {name}")


@pytest.mark.parametrize("stem", STEMS)
def test_colab_and_github_links_beside_the_downloads(real_site, stem):
    page = soup(real_site.html / "auto_tutorials" / f"{stem}.html")
    repo, branch = conf_value("tutorials_github_repo"), conf_value("tutorials_github_branch")
    colab = f"https://colab.research.google.com/github/{repo}/blob/notebooks/{stem}.ipynb"
    github = f"https://github.com/{repo}/blob/{branch}/tutorials/{stem}.py"
    footer = page.select_one(".sphx-glr-footer")
    assert footer is not None and footer.select("a.reference.download"), f"{stem}: no download footer"
    assert [a["href"] for a in footer.select("a.tutorial-colab-link")] == [colab]
    assert [a["href"] for a in footer.select("a.tutorial-github-link")] == [github]
    assert footer.select_one("a.tutorial-colab-link").get_text() == "Run in Google Colab"
    assert footer.select_one("a.tutorial-github-link").get_text() == "View source on GitHub"
    side = page.select_one(".tutorial-links")
    assert side is not None and {a["href"] for a in side.select("a")} == {colab, github}


@pytest.mark.parametrize("stem", STEMS)
def test_no_empty_code_block(real_site, stem):
    blocks = soup(real_site.html / "auto_tutorials" / f"{stem}.html").select("div.highlight pre")
    assert blocks and all(b.get_text().strip() for b in blocks), f"{stem}: an empty code block"


def test_landing_page_links_every_tutorial_with_a_thumbnail(real_site):
    page = soup(real_site.html / "index.html")
    cards = page.select(".tutorial-card")
    linked = {}
    for card in cards:
        link = card.select_one("a.sd-stretched-link[href]")
        assert link is not None, "a card without a link"
        href = link["href"]
        img = card.find("img")
        assert img is not None and (real_site.html / img["src"]).is_file(), f"card {href}: no thumbnail"
        linked[Path(href.split("#")[0]).stem] = card.get_text(" ", strip=True)
    assert set(linked) == set(STEMS), f"cards {sorted(linked)} vs tutorials {STEMS}"
    assert all(len(text) > 40 for text in linked.values()), "a card without a description"


@pytest.mark.parametrize("stem", STEMS)
def test_environment_stamp(real_site, stem):
    page = soup(real_site.html / "auto_tutorials" / f"{stem}.html")
    stamp = page.select_one(".build-stamp")
    assert stamp is not None, f"{stem}: no environment stamp"
    text = stamp.get_text(" ", strip=True)
    assert f"PyTorch {torch.__version__}" in text
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU,"
    assert device in text, text
    assert "torch.compile cache" in text and "make check-versions" in text, text


def test_no_third_party_resources(real_site):
    offenders = {}
    for path in real_site.html.rglob("*.html"):
        found = external_resources(soup(path))
        if found:
            offenders[str(path.relative_to(real_site.html))] = found
    assert not offenders, offenders
    for css in real_site.html.rglob("*.css"):
        text = css.read_text(errors="replace")
        assert not re.search(r"(@import|url\()\s*['\"]?(https?:)?//", text), f"{css} loads a remote resource"


def test_second_build_executes_nothing(real_site):
    again = build(real_site.src)
    assert again.returncode == 0, again.log[-5000:]
    m = re.search(r"successfully executed (\d+) out of (\d+) file", again.log)
    assert m, again.log[-3000:]
    assert int(m.group(1)) == 0, "a tutorial re-ran although nothing changed"
    skipped = re.search(r"after excluding (\d+) file", again.log)
    assert skipped and int(skipped.group(1)) == len(STEMS)
    # CPU time: a loaded or paused machine stretches the wall-clock time,
    # not the work done.
    assert again.cpu_seconds < 60, f"no-change rebuild took {again.cpu_seconds:.1f} s of CPU"
    print(f"no-change rebuild: {again.seconds:.1f} s, {again.cpu_seconds:.1f} s of CPU")
