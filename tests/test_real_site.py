"""Checks on the real site, built once per session from a clean copy."""

from __future__ import annotations

import ast
import re
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from urllib.parse import unquote

import nbformat
import pytest
import torch

from pages import download_links, external_resources, printed, run_seconds, soup
from sitebuild import REPO, STEMS, build

sys.path.insert(0, str(REPO / "sphinxext"))
import downloads  # noqa: E402
from gallery_layout import page_modules  # noqa: E402

# rST that a notebook shows as it is, not rendered (outside fenced code,
# which shows source: the toolkit's docstrings hold roles).
RST_DIRECTIVE = re.compile(r"^\s*\.\. [\w:-]+::", re.M)
RST_ROLE = re.compile(r":[\w:]+:`")
FENCED = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", re.M | re.S)


def notebook_problems(nb) -> list[str]:
    """What keeps a downloaded notebook from reading as its page: rST in a
    markdown cell, an empty code cell, a first cell that is not its title,
    and anything but one install cell second."""
    found = []
    for i, cell in enumerate(nb.cells, 1):
        if cell.cell_type == "markdown":
            prose = FENCED.sub("", cell.source)
            found += [f"cell {i}: rST directive {m[0].strip()!r}" for m in RST_DIRECTIVE.finditer(prose)]
            found += [f"cell {i}: rST role {m[0]!r}" for m in RST_ROLE.finditer(prose)]
        elif cell.cell_type == "code" and not cell.source.strip():
            found.append(f"cell {i}: an empty code cell")
    if not nb.cells or nb.cells[0].cell_type != "markdown" or not nb.cells[0].source.startswith("# "):
        found.append(f"cell 1 is not the title: {nb.cells[0].source[:60]!r}" if nb.cells else "no cells")
    installs = [i for i, c in enumerate(nb.cells, 1) if c.source.startswith(downloads.INSTALL_HEAD)]
    if installs != [2]:
        found.append(f"install cells at {installs}, not one at 2")
    return found


def own_downloads(html: Path) -> dict[str, str]:
    """The page's own .py and .ipynb links, without "Download the toolkit"."""
    page = soup(html)
    for a in page.select("a.tutorial-toolkit-link"):
        a.decompose()
    return download_links(page)


def toolkit_wheel(site) -> bytes:
    """The wheel the build made of the site's toolkit."""
    return (site.src / downloads.wheel_path(site.src)).read_bytes()


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
    links = own_downloads(html)
    assert set(links) == {".py", ".ipynb"}, f"{stem}: download links {links}"
    for suffix, href in links.items():
        target = (html.parent / href).resolve()
        assert target.is_file(), f"{stem}: {href} does not exist"
        assert target.name == stem + suffix
    nb = nbformat.read((html.parent / links[".ipynb"]).resolve(), as_version=4)
    nbformat.validate(nb)
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    # Installs only what is missing or older than requirements-minimum.txt, and the wheel.
    wheel = downloads.wheel_path(real_site.src).name
    assert first_code.source.startswith(downloads.INSTALL_HEAD) and "==" not in first_code.source
    assert f'"{wheel}"' in first_code.source and f"/{wheel}\"" in first_code.source


@pytest.mark.parametrize("stem", STEMS)
def test_notebook_opens_with_the_title_and_is_markdown(real_site, stem):
    html = real_site.html / "auto_tutorials" / f"{stem}.html"
    nb = nbformat.read((html.parent / own_downloads(html)[".ipynb"]).resolve(), as_version=4)
    problems = notebook_problems(nb)
    assert not problems, f"{stem}.ipynb:\n" + "\n".join(problems[:20])
    assert "What you will learn" in nb.cells[0].source, f"{stem}.ipynb: cell 1 has no 'What you will learn'"


@pytest.mark.parametrize("stem", STEMS)
def test_downloaded_py_is_the_page_then_the_modules_it_imports(real_site, stem):
    html = real_site.html / "auto_tutorials" / f"{stem}.html"
    script = (html.parent / own_downloads(html)[".py"]).read_text(encoding="utf-8")
    source = (real_site.src / "tutorials" / f"{stem}.py").read_text(encoding="utf-8")
    head = script[:script.index(downloads.LOADER)]
    assert source.startswith(head) and len(head) > 200, f"{stem}.py does not start with the page's own code"
    assert script.replace(downloads.LOADER, "").startswith(source.rstrip("\n")), f"{stem}.py changed the page"
    body = ast.parse(script).body
    call = body[-1].value
    assert isinstance(call, ast.Call) and call.func.id == "_unpack_toolkit", f"{stem}.py does not end unpacking"
    carried = ast.literal_eval(call.args[0])
    wanted = {f"{name.replace('.', '/')}{'/__init__' if (real_site.src / name.replace('.', '/')).is_dir() else ''}.py"
              for name in page_modules(real_site.src / "tutorials" / f"{stem}.py", real_site.src)}
    assert set(carried) == wanted, f"{stem}.py carries {sorted(carried)}, imports {sorted(wanted)}"
    for name, text in carried.items():
        assert text == (real_site.src / name).read_text(encoding="utf-8"), f"{stem}.py carries another {name}"


@pytest.mark.parametrize("stem", STEMS)
def test_every_page_links_the_toolkit(real_site, stem):
    html = real_site.html / "auto_tutorials" / f"{stem}.html"
    page, wheel = soup(html), toolkit_wheel(real_site)
    for where, selector in (("footer", ".sphx-glr-footer"), ("side bar", ".tutorial-toolkit")):
        scope = page.select_one(selector)
        links = scope.select("a.tutorial-toolkit-link") if scope is not None else []
        assert len(links) == 1, f"{stem}: {len(links)} toolkit links in the {where}"
        assert "Download the toolkit" in links[0].get_text(), f"{stem}: {links[0].get_text()!r}"
        target = (html.parent / unquote(links[0]["href"])).resolve()  # the wheel's version has a "+"
        assert target.suffix == ".whl" and target.read_bytes() == wheel, f"{stem}: {where} link {links[0]['href']}"


@pytest.mark.parametrize("stem", STEMS)
def test_zip_holds_the_downloads_and_the_toolkit(real_site, stem):
    html = real_site.html / "auto_tutorials" / f"{stem}.html"
    links = own_downloads(html)
    zips = {a["href"] for a in soup(html).select("a.reference.download") if a["href"].endswith(".zip")}
    assert len(zips) == 1, f"{stem}: zip links {zips}"
    with zipfile.ZipFile((html.parent / zips.pop()).resolve()) as zf:
        files = {name: zf.read(name) for name in zf.namelist()}
    wheel = downloads.wheel_path(real_site.src).name
    assert set(files) == {f"{stem}.py", f"{stem}.ipynb", wheel}, sorted(files)
    for suffix in (".py", ".ipynb"):
        assert files[stem + suffix] == (html.parent / links[suffix]).resolve().read_bytes(), f"{stem}{suffix}"
    assert files[wheel] == toolkit_wheel(real_site)


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
    assert "this build's own torch.compile cache" in text and "make check-versions" in text, text


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
    print(f"no-change rebuild: {again.seconds:.1f} s, {again.cpu_seconds:.1f} s of CPU")  # a figure, not a test


GLOSSARY_PAGE = "ragged_batches_intro"
GLOSSARY_TERMS = {"work bound", "fraction of the bound", "kernel label", "quick mode",
                  "the original tutorial's baseline"}


def test_the_intro_page_defines_the_glossary(real_site):
    page = soup(real_site.html / "auto_tutorials" / f"{GLOSSARY_PAGE}.html")
    terms = {dt.get_text(" ", strip=True).rstrip("¶#").strip().replace("\u2019", "'")
             for dt in page.select("dl.glossary dt")}
    assert GLOSSARY_TERMS <= terms, f"glossary terms: {sorted(terms)}"


@pytest.mark.parametrize("stem", [s for s in STEMS if s != GLOSSARY_PAGE])
def test_every_page_links_the_glossary(real_site, stem):
    page = soup(real_site.html / "auto_tutorials" / f"{stem}.html")
    article = page.select_one("article") or page
    hrefs = [a.get("href", "") for a in article.select("a[href]")]
    to_glossary = [h for h in hrefs if h.startswith(f"{GLOSSARY_PAGE}.html#term-")
                   or h == f"{GLOSSARY_PAGE}.html#glossary"]
    assert to_glossary, f"{stem}: no link to the glossary on {GLOSSARY_PAGE}"


# The glossary terms an output can print, by the id of their entry
# (``#term-...``), and how a printed line shows them: a kernel label is the
# bracket after a timing ("[CPU flash x12]").
KERNEL_LABELS = ("CPU flash", "flash", "memory-efficient", "cuDNN", "math", "compiled graph", "FlexAttention")
PRINTED_TERMS = {
    "work-bound": re.compile(r"\bwork bound\b"),
    "fraction-of-the-bound": re.compile(r"\bfraction of (the )?bound\b"),
    "kernel-label": re.compile(r"ms \(IQR [^\n]*\[(" + "|".join(map(re.escape, KERNEL_LABELS)) + ")"),
    "quick-mode": re.compile(r"\bquick mode\b"),
}


@pytest.mark.parametrize("stem", STEMS)
def test_terms_are_linked_before_an_output_prints_them(real_site, stem):
    """Each glossary term a page's output prints is linked from the page's
    text before the first output that prints it: a reader meets its meaning
    before its number."""
    article = soup(real_site.html / "auto_tutorials" / f"{stem}.html").select_one("article")
    linked, late = set(), {}
    for tag in article.find_all(lambda t: t.name == "a" or "sphx-glr-script-out" in (t.get("class") or [])):
        if tag.name == "a":
            linked.add(tag.get("href", "").partition("#term-")[2])
            continue
        for term, shown in PRINTED_TERMS.items():
            match = shown.search(tag.get_text())
            if match and term not in linked and term not in late:
                line = next(ln for ln in tag.get_text().splitlines() if shown.search(ln) or match[0] in ln)
                late[term] = line.strip()
    assert not late, f"{stem}: printed before the page links its glossary entry: {late}"


# a figure beside its bound, or a timing: the lines the GPU check and the
# site's GPU results read, as records (ragged_site.records)
FIGURE_LINE = re.compile(r"\b(?:work|slot) bound \d|\bms \(IQR ")


@pytest.mark.parametrize("stem", STEMS)
def test_every_printed_figure_is_recorded(real_site, stem):
    """Each output line of a page that prints a figure beside its bound, or a
    timing, is also a record in ``<stem>.figures.jsonl`` beside the page's
    output: the record, not the printed text, is what the GPU check reads."""
    from ragged_site.records import read_records

    figures = [ln.strip() for ln in printed(real_site.src, stem).splitlines() if FIGURE_LINE.search(ln)]
    records = read_records(real_site.src / "auto_tutorials" / f"{stem}.figures.jsonl")
    recorded = {r["line"].strip() for r in records}
    missing = [ln for ln in figures if ln not in recorded]
    assert not missing, f"{stem} prints figures it does not record: {missing}"
    for r in records:
        if "fraction" in r and r.get("bound"):
            assert abs(r["fraction"] - r["speedup"] / r["bound"]) < 1e-9, r


@pytest.mark.parametrize("stem", STEMS)
def test_tags_line_is_words(real_site, stem):
    """The tags under a page are words: no emoji, which shows as a
    missing-glyph box where no emoji font is installed (conf.py)."""
    page = soup(real_site.html / "auto_tutorials" / f"{stem}.html")
    tags = page.select_one(".sphx-glr-example-tags")
    if tags is not None:
        assert tags.get_text(" ", strip=True).startswith("Tags:"), tags.get_text(" ", strip=True)


def test_landing_page_starts_here_then_tracks(real_site):
    """The landing page says where to start and lists the pages in numbered
    tracks (gallery_layout.TRACKS), in reading order."""
    from gallery_layout import TRACKS

    page = soup(real_site.html / "index.html")
    start = next(p for p in page.select("p") if p.get_text().startswith("Start here:"))
    first = next(iter(TRACKS.values()))[0]
    assert start.select_one("a")["href"].endswith(f"auto_tutorials/{first}.html"), start
    rubrics = [r.get_text(strip=True) for r in page.select("p.rubric")]
    assert rubrics[: len(TRACKS)] == [f"{i}. {name}" for i, name in enumerate(TRACKS, 1)], rubrics
    cards = [Path(a["href"]).stem for a in page.select(".sd-card a.sd-stretched-link")]
    assert cards == [s for stems in TRACKS.values() for s in stems if s in STEMS], cards


@pytest.mark.parametrize("stem", STEMS)
def test_every_page_shows_the_reading_order_and_its_place(real_site, stem):
    """Under its title, the page's track and place; at its end, every track
    with this page marked (not linked) and the next page of its track linked."""
    from gallery_layout import TRACKS, track_of

    page = soup(real_site.html / "auto_tutorials" / f"{stem}.html")
    track, place = track_of(stem)
    where = page.select_one("p.reading-place")
    assert where is not None and f"{track}: page {place} of {len(TRACKS[track])}" in where.get_text(), where
    box = page.select_one(".reading-order")
    assert box is not None, f"{stem}: no reading order"
    linked = [Path(a["href"]).stem for a in box.select("li a")]
    assert linked == [s for stems in TRACKS.values() for s in stems if s != stem and s in STEMS], linked
    assert "(this page)" in box.select_one("li.this-page").get_text()
    following = TRACKS[track][place:place + 1]
    nxt = box.select_one(".next-in-track a")
    assert ([Path(nxt["href"]).stem] if nxt else []) == following, (nxt, following)
