"""The built site in a real browser: Debian's Chromium, headless, via Selenium.

Screenshots of every page are saved under ``artifacts/screenshots/``.
"""

from __future__ import annotations

import functools
import http.server
import json
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
    real_site = request.getfixturevalue("real_site")
    server, base = serve(real_site.html)
    driver = make_driver()
    yield driver, base, real_site.html
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
