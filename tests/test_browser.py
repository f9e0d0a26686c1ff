"""The built site in a real browser: Debian's Chromium, headless, via Selenium.

Screenshots of every page are saved under ``artifacts/screenshots/``.

``BROWSER_SITE=/path/to/_build/html pytest tests/test_browser.py`` runs these
tests on a site that is already built instead of building one.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest

from sitebuild import REPO, STEMS

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SHOTS = REPO / "artifacts" / "screenshots"

MISSING = ("the browser tests need Debian's chromium and chromium-driver: "
           "sudo apt-get install chromium chromium-driver (or deselect them: -m 'not browser')")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # the browser cancelling a request is not a test failure


def serve(root: Path):
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def make_driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic", "--window-size=1280,1600"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    # Generous: the machine may be loaded, or paused for a minute.
    driver.set_script_timeout(300)
    driver.set_page_load_timeout(300)
    return driver


@pytest.fixture(scope="module")
def browser(request):
    # Checked here, not at import: a run that deselects the browser tests
    # (-m "not browser") never asks for this fixture. A selected test fails
    # before the site is built.
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail(MISSING, pytrace=False)
    if os.environ.get("BROWSER_SITE"):
        html = Path(os.environ["BROWSER_SITE"]).resolve()
        assert (html / "index.html").is_file(), f"BROWSER_SITE={html}: no index.html there"
    else:
        html = request.getfixturevalue("real_site").html
    server, base = serve(html)
    driver = make_driver()
    yield driver, base, html
    driver.quit()
    server.shutdown()


TUTORIAL_PAGES = [f"auto_tutorials/{stem}.html" for stem in STEMS]
OTHER_PAGES = ["index.html", "auto_tutorials/index.html", "sg_execution_times.html",
               "auto_tutorials/sg_execution_times.html", "search.html"]


def requested_hosts(driver) -> set[str]:
    hosts = set()
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg.get("method") == "Network.requestWillBeSent":
            url = msg["params"]["request"]["url"]
            if url.startswith(("http:", "https:", "ws:", "wss:")):
                hosts.add(urlparse(url).hostname)
    return hosts


def open_page(driver, url):
    driver.get(url)
    driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "if (document.readyState === 'complete') done(); else window.addEventListener('load', () => done());")


@pytest.mark.parametrize("rel", OTHER_PAGES + TUTORIAL_PAGES)
def test_page_in_browser(browser, rel):
    driver, base, html_root = browser
    driver.get_log("browser"), driver.get_log("performance")  # drop earlier entries
    url = urljoin(base, rel)
    open_page(driver, url)

    # Math, where there is any, is typeset by the local MathJax. The wait
    # counts polls, not elapsed time, so a paused machine does not end it.
    if driver.execute_script("return document.querySelectorAll('.math').length"):
        driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "let polls = 0; (function wait() {"
            " if (window.MathJax && MathJax.startup && MathJax.startup.promise)"
            "  MathJax.startup.promise.then(() => done());"
            " else if (++polls > 600) done(); else setTimeout(wait, 100); })();")
        typeset = driver.execute_script("return document.querySelectorAll('mjx-container').length")
        assert typeset > 0, f"{rel}: math did not render"

    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / (rel.replace("/", "__").replace(".html", ".png"))))

    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"{rel}: console errors {errors}"
    assert requested_hosts(driver) <= {"127.0.0.1"}, f"{rel}: requests to other hosts"

    broken_images = driver.execute_script(
        "return [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)")
    assert not broken_images, f"{rel}: images that did not load: {broken_images}"

    links = driver.execute_script(
        "return [...document.querySelectorAll('a[href]')].map(a => a.href)")
    for link in {l.split("#")[0] for l in links if l.startswith(base)}:
        with urllib.request.urlopen(link) as resp:
            assert resp.status == 200, f"{rel}: link {link} answers {resp.status}"

    if rel in TUTORIAL_PAGES:
        blocks = driver.execute_script("return document.querySelectorAll('div.highlight').length")
        buttons = driver.execute_script("return document.querySelectorAll('button.copybtn').length")
        assert blocks > 0 and buttons == blocks, f"{rel}: {buttons} copy buttons for {blocks} code blocks"
        downloads = driver.execute_script(
            "return [...document.querySelectorAll('a.reference.download')].map(a => a.href)"
            ".filter(h => h.endsWith('.py') || h.endsWith('.ipynb'))")
        assert {Path(d).suffix for d in downloads} == {".py", ".ipynb"}, downloads
        for href in downloads:
            size = driver.execute_async_script(
                "const done = arguments[arguments.length - 1];"
                "fetch(arguments[0]).then(r => r.ok ? r.text() : '').then(t => done(t.length))"
                ".catch(() => done(-1));", href)
            assert size > 100, f"{rel}: download {href} fetched {size} characters"


# -- Widths: what fits the content column at 1280 px, and nothing wider than
# the window at 400 px. The window is set exactly (device metrics, one CSS
# pixel per device pixel); a vertical scroll bar takes its width from it, as
# in a desktop browser.

WIDE, NARROW, HEIGHT = 1280, 400, 900
# Every page the site has, for the narrow window: the tutorials, the landing
# page and the other pages, and the toolkit's reference where there is one.
ALL_PAGES = OTHER_PAGES + TUTORIAL_PAGES + (["toolkit.html"] if (REPO / "toolkit.rst").exists() else [])


def open_at(driver, base, html_root, rel, width):
    """Open ``rel`` in a window ``width`` CSS pixels wide, every <details>
    open, every image loaded and every formula typeset."""
    if not (html_root / rel).is_file():
        if os.environ.get("BROWSER_SITE"):
            pytest.skip(f"{rel}: not in BROWSER_SITE")
        pytest.fail(f"{rel}: not built")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
    open_page(driver, urljoin(base, rel))
    driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "document.querySelectorAll('details').forEach(d => { d.open = true; });"
        "const imgs = [...document.images];"
        "imgs.forEach(i => { i.loading = 'eager'; });"
        "const loaded = Promise.all(imgs.map(i => i.complete ? null"
        " : new Promise(r => { i.addEventListener('load', r); i.addEventListener('error', r); })));"
        "let polls = 0; (function wait() {"
        " if (!document.querySelector('.math')) loaded.then(() => done());"
        " else if (window.MathJax && MathJax.startup && MathJax.startup.promise)"
        "  Promise.all([loaded, MathJax.startup.promise]).then(() => done());"
        " else if (++polls > 600) done(); else setTimeout(wait, 100); })();")
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / rel.replace("/", "__").replace(".html", f"@{width}.png")))


@pytest.fixture
def at_width(browser):
    driver, base, html_root = browser
    yield lambda rel, width: open_at(driver, base, html_root, rel, width)
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


# Each code block that scrolls sideways and each output block that wraps: the
# lines that are wider than the block's text area, and by how many pixels. The lines are
# measured in a copy of the block's font, so the report names the line
# whatever the font's width.
OVERFLOWING_BLOCKS_JS = r"""
const out = [];
for (const pre of document.querySelectorAll('div.highlight pre')) {
  const kind = pre.closest('.sphx-glr-script-out') ? 'output' : 'code';
  const cs = getComputedStyle(pre);
  const wraps = cs.whiteSpace.startsWith('pre-wrap');
  if (!wraps && pre.scrollWidth <= pre.clientWidth + 1) continue;
  const room = pre.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
  const probe = document.createElement('span');
  probe.style.cssText = 'position:absolute; visibility:hidden; white-space:pre; left:0; top:0';
  pre.appendChild(probe);
  const lines = [];
  for (const text of pre.textContent.split('\n')) {
    probe.textContent = text;
    const w = probe.getBoundingClientRect().width;
    if (w > room + 1) lines.push({line: text, over: Math.ceil(w - room), chars: text.length});
  }
  probe.remove();
  if (lines.length || !wraps) out.push({kind, wraps, lines,
      over: pre.scrollWidth - pre.clientWidth});
}
return out;
"""


# The printed lines that an issue gives "exactly", for tools to read: these
# may be wider than the column, and wrap there; nothing else may.
EXACT_LINE = re.compile(
    r"transformers \S+: packed rows with 'sdpa' attend across documents"
    r"|token imbalance \(max/mean tokens per rank\):"
    r"|data-parallel step: world size"
    r"|corpus: \d+ documents from "
    r"|(?:hf )?training against length-grouped padding: ragged"
    r"|transformers \S+ .* on a packed row: max difference from each document alone"
    r"|recurrent layer [\w ]+: packed \d+ tokens/s"
    r"|hybrid training: packed \d+ tokens/s"
    r"|latency of \w+ \(arrivals at"
    r"|serving: continuous \d+ tokens/s"
    r"|paged KV cache: \d+ concurrent requests"
    r"|prefix cache: hit rate \d+%"
    r"|shared-prefix attention: \d+ requests over a prefix")


@pytest.mark.parametrize("rel", TUTORIAL_PAGES)
def test_code_and_output_fit_the_column(at_width, browser, rel):
    """At a 1280 px window no code or printed line is clipped: every code
    block and every output block is as wide as its widest line."""
    at_width(rel, WIDE)
    driver = browser[0]
    assert driver.execute_script("return document.querySelectorAll('div.highlight pre').length") > 0
    report = []
    for b in driver.execute_script(OVERFLOWING_BLOCKS_JS):
        # An output line whose exact form tools read may wrap (the CSS wraps
        # output at this width); every other line must fit.
        lines = [x for x in b["lines"]
                 if not (b["kind"] == "output" and b["wraps"] and EXACT_LINE.match(x["line"]))]
        if b["lines"] and not lines:
            continue
        report += [f"  {b['kind']} block {x['over']} px too wide: "
                   f"{x['chars']} characters: {x['line'][:140]!r}" for x in lines[:1]] or [
            f"  {b['kind']} block {b['over']} px too wide: (no single line)"]
    if report:
        pytest.fail(f"{rel} at {WIDE} px: {len(report)} block(s) do not fit\n" + "\n".join(report),
                    pytrace=False)


# Each figure at its drawn size: the width of its 1x image (the srcset
# candidate for one device pixel per CSS pixel, else its src) or its width
# attribute, against the width it is shown at.
FIGURE_SIZES_JS = r"""
const done = arguments[arguments.length - 1];
const imgs = [...document.querySelectorAll('img.sphx-glr-single-img, img.sphx-glr-multi-img')];
function oneX(img) {
  for (const cand of (img.getAttribute('srcset') || '').split(',')) {
    const [url, desc] = cand.trim().split(/\s+/);
    if (url && (!desc || (desc.endsWith('x') && parseFloat(desc) === 1))) return new URL(url, document.baseURI).href;
  }
  return img.currentSrc || img.src;
}
Promise.all(imgs.map(img => new Promise(resolve => {
  const cs = getComputedStyle(img);
  const shown = img.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
  const attr = parseFloat(img.getAttribute('width'));
  if (attr > 0) { resolve({src: img.getAttribute('src'), drawn: attr, shown}); return; }
  const probe = new Image();
  probe.onload = () => resolve({src: img.getAttribute('src'), drawn: probe.naturalWidth, shown});
  probe.onerror = () => resolve({src: img.getAttribute('src'), drawn: null, shown});
  probe.src = oneX(img);
}))).then(done);
"""


@pytest.mark.parametrize("rel", TUTORIAL_PAGES)
def test_figures_shown_at_drawn_size(at_width, browser, rel):
    """At a 1280 px window no figure is scaled down (its text keeps the size
    it was drawn at)."""
    at_width(rel, WIDE)
    figures = browser[0].execute_async_script(FIGURE_SIZES_JS)
    assert all(f["drawn"] for f in figures), f"{rel}: figures that did not load: {figures}"
    shrunk = [f for f in figures if f["shown"] < 0.96 * f["drawn"]]
    if shrunk:
        pytest.fail(f"{rel} at {WIDE} px: figures shown narrower than drawn: " + ", ".join(
            f"{Path(f['src']).name} {f['shown']} px of {f['drawn']} px" for f in shrunk), pytrace=False)


# Each printed output block whose text is wider than the block (it scrolls
# sideways), with its widest line; each figure and the link around it.
OUTPUT_SCROLLS_JS = r"""
const out = [];
for (const pre of document.querySelectorAll('.sphx-glr-script-out div.highlight pre')) {
  if (pre.scrollWidth <= pre.clientWidth + 1) continue;
  const widest = pre.textContent.split('\n').reduce((a, b) => (b.length > a.length ? b : a), '');
  out.push({over: pre.scrollWidth - pre.clientWidth, line: widest.slice(0, 120)});
}
return out;
"""
FIGURE_LINKS_JS = r"""
return [...document.querySelectorAll('img.sphx-glr-single-img, img.sphx-glr-multi-img')].map(img => {
  const a = img.closest('a');
  return {src: img.getAttribute('src'), href: a ? a.href : null,
          resolved: new URL(img.getAttribute('src'), document.baseURI).href};
});
"""


@pytest.mark.parametrize("rel", TUTORIAL_PAGES)
def test_output_wraps_and_figures_open_full_size_on_a_phone(at_width, browser, rel):
    """At a 400 px window no printed output block scrolls sideways (a result
    line wraps under itself; code may scroll), and every figure is a link
    to its own image file, which opens at full size."""
    at_width(rel, NARROW)
    driver = browser[0]
    scrolling = driver.execute_script(OUTPUT_SCROLLS_JS)
    assert not scrolling, f"{rel} at {NARROW} px: output blocks that scroll sideways: " + "; ".join(
        f"{b['over']} px, {b['line']!r}" for b in scrolling[:4])
    figures = driver.execute_script(FIGURE_LINKS_JS)
    unlinked = [f["src"] for f in figures if f["href"] != f["resolved"]]
    assert not unlinked, f"{rel}: figures that do not open at full size: {unlinked}"


# The outermost elements that stick out of the window on either side, apart
# from those inside a box that scrolls or clips them, for the failure message.
STICKING_OUT_JS = r"""
const room = document.documentElement.clientWidth;
const clipped = el => {
  for (let p = el.parentElement; p && p !== document.body; p = p.parentElement) {
    const cs = getComputedStyle(p);
    if (cs.position === 'fixed') return true;
    if (cs.overflowX !== 'visible') {
      const r = p.getBoundingClientRect();
      if (r.right <= room + 1 && r.left >= -1) return true;
    }
  }
  return false;
};
const out = [], seen = new Set();
for (const el of document.body.querySelectorAll('*')) {
  const r = el.getBoundingClientRect();
  if (!r.width || (r.right <= room + 1 && r.left >= -1)) continue;
  if (getComputedStyle(el).visibility === 'hidden' || clipped(el)) continue;
  seen.add(el);
  if (seen.has(el.parentElement)) continue;
  const name = el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
    [...el.classList].slice(0, 3).map(c => '.' + c).join('');
  out.push(`${name} (${Math.round(r.left)}..${Math.round(r.right)} px): ` +
           JSON.stringify((el.textContent || el.getAttribute('src') || '').trim().slice(0, 60)));
  if (out.length >= 8) break;
}
return out;
"""


@pytest.mark.parametrize("rel", ALL_PAGES)
def test_no_sideways_scroll_when_narrow(at_width, browser, rel):
    """At a 400 px window no page scrolls sideways: only code and output
    blocks may scroll inside themselves."""
    at_width(rel, NARROW)
    driver = browser[0]
    page, room = driver.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    if page > room:
        out = driver.execute_script(STICKING_OUT_JS)
        pytest.fail(f"{rel} at {NARROW} px: the page is {page} px wide in a {room} px window; "
                    "sticking out:\n  " + "\n  ".join(out), pytrace=False)


@pytest.mark.parametrize("rel", TUTORIAL_PAGES)
def test_no_output_hidden_in_a_box_that_scrolls_down(at_width, browser, rel):
    """Every printed output shows whole, at either width: no output block is
    taller than the box it sits in (Sphinx-Gallery's own style caps it at
    30em, and the end of a long table was hidden below)."""
    for width in (WIDE, NARROW):
        at_width(rel, width)
        hidden = browser[0].execute_script(
            "return [...document.querySelectorAll('.sphx-glr-script-out pre')]"
            ".filter(p => p.scrollHeight > p.clientHeight + 1)"
            ".map(p => p.textContent.trim().slice(0, 60))")
        assert not hidden, f"{rel} at {width} px: output in a box that scrolls down: {hidden}"


# The decision guide of which_attention_path, a table the page prints as
# HTML: at either width its last row, the last job's verdict, shows whole in
# the page, not inside a box that scrolls or clips it (issue 32: printed as
# text, its last verdicts sat below the output box's height cap, and at
# 400 px its lines were cut off mid-word).
GUIDE_PAGE = "auto_tutorials/which_attention_path.html"
GUIDE_LAST_ROW_HIDDEN_JS = r"""
const table = document.querySelector('table.decision-guide');
if (!table) return 'no table.decision-guide on the page';
const row = table.querySelector('tbody tr:last-child');
if (!row || !/serving/.test(row.cells[0].textContent)) return 'its last row is not the serving job';
const r = row.getBoundingClientRect(), room = document.documentElement.clientWidth;
if (r.left < -1 || r.right > room + 1) return `its last row spans ${Math.round(r.left)}..${Math.round(r.right)} px`;
for (let p = row.parentElement; p && p !== document.body; p = p.parentElement) {
  const cs = getComputedStyle(p);
  if (cs.overflowX === 'visible' && cs.overflowY === 'visible') continue;
  const name = p.tagName.toLowerCase() + [...p.classList].slice(0, 3).map(c => '.' + c).join('');
  if (p.scrollHeight > p.clientHeight + 1 || p.scrollWidth > p.clientWidth + 1)
    return `${name} scrolls (${p.scrollWidth}x${p.scrollHeight} px in ${p.clientWidth}x${p.clientHeight})`;
  const b = p.getBoundingClientRect();
  if (r.top < b.top - 1 || r.bottom > b.bottom + 1 || r.left < b.left - 1 || r.right > b.right + 1)
    return `${name} clips its last row`;
}
for (const cell of table.querySelectorAll('th, td'))
  if (cell.scrollWidth > cell.clientWidth + 1) return `a cell is cut: ${JSON.stringify(cell.textContent.slice(0, 60))}`;
return null;
"""


@pytest.mark.parametrize("width", [WIDE, NARROW])
def test_decision_guide_shows_whole(at_width, browser, width):
    at_width(GUIDE_PAGE, width)
    problem = browser[0].execute_script(GUIDE_LAST_ROW_HIDDEN_JS)
    assert problem is None, f"{GUIDE_PAGE} at {width} px: {problem}"
