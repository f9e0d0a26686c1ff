"""Reading built pages."""

from __future__ import annotations

import re
from pathlib import Path

from bs4 import BeautifulSoup

TIME_RE = re.compile(r"Total running time of the script:\s*\((\d+) minutes ([\d.]+) seconds\)")


def soup(path: Path) -> BeautifulSoup:
    return BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")


def run_seconds(page: BeautifulSoup) -> float:
    m = TIME_RE.search(page.get_text(" "))
    assert m, "no 'Total running time' line on the page"
    return 60 * int(m.group(1)) + float(m.group(2))


def download_links(page: BeautifulSoup) -> dict[str, str]:
    """Suffix ('.py', '.ipynb') -> href of the page's download links."""
    links = {}
    for a in page.select("a.reference.download"):
        href = a.get("href", "")
        for suffix in (".py", ".ipynb"):
            if href.endswith(suffix):
                links[suffix] = href
    return links


def external_resources(page: BeautifulSoup) -> list[str]:
    """Every resource the page makes the browser load from another host."""
    found = []
    for tag, attr in (("script", "src"), ("link", "href"), ("img", "src"),
                      ("iframe", "src"), ("source", "src"), ("video", "src")):
        for el in page.find_all(tag):
            url = el.get(attr)
            if not url:
                continue
            if tag == "link" and not set(el.get("rel", [])) & {
                    "stylesheet", "preload", "icon", "modulepreload", "prefetch", "manifest"}:
                continue
            if re.match(r"^(https?:)?//", url):
                found.append(f"<{tag} {attr}={url}>")
    return found


def printed(site: Path, stem: str) -> str:
    """Everything a built tutorial page shows as its code's output (printed
    text, tracebacks), from ``site``'s HTML."""
    page = soup(site / "_build" / "html" / "auto_tutorials" / f"{stem}.html")
    return "\n".join(block.get_text() for block in page.select("div.sphx-glr-script-out"))
