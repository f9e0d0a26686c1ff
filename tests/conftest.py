from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from sitebuild import FIXTURES, REPO, Build, build, make_site


def pytest_report_header(config):
    return f"site sources: {REPO}"


def _real_site_sources(tmp_path_factory) -> Path:
    """A clean copy of the site (in the calling thread: pytest's temporary
    folders are not thread-safe)."""
    src = make_site(tmp_path_factory.mktemp("real") / "site")
    cached = REPO / "auto_tutorials"
    if os.environ.get("TEST_REUSE_GALLERY") == "1" and cached.is_dir():
        shutil.copytree(cached, src / "auto_tutorials")
    return src


def pytest_collection_modifyitems(session, config, items):
    """The tests that need the real site run last: its build starts with the
    first test and runs beside the others (it keeps one core of two busy for
    minutes; each of them mostly one core too)."""
    needs = {id(item) for item in items if _needs_real_site(item)}
    items[:] = [i for i in items if id(i) not in needs] + [i for i in items if id(i) in needs]


def _needs_real_site(item) -> bool:
    names = getattr(item, "fixturenames", ())
    return "real_site" in names or ("browser" in names and not os.environ.get("BROWSER_SITE"))  # asks for it


_background: list[Future] = []  # the real site's build, once begun


@pytest.fixture(scope="session", autouse=True)
def _real_site_in_background(request, tmp_path_factory):
    needs = [_needs_real_site(item) for item in request.session.items]
    # Only with something to run beside it: a session of browser tests alone
    # (a test runs one without Chromium) fails before it asks for the site.
    if any(needs) and not all(needs):
        future, src = Future(), _real_site_sources(tmp_path_factory)

        def run():  # a daemon thread: a session that stops early does not wait for the build
            try:
                future.set_result(build(src))
            except BaseException as err:  # noqa: BLE001 - raised again where the site is asked for
                future.set_exception(err)

        threading.Thread(target=run, name="real site build", daemon=True).start()
        _background.append(future)


@pytest.fixture(scope="session")
def real_site(tmp_path_factory) -> Build:
    """The real site, built once per test session from a clean copy (begun
    in the background at the session's first test).

    Set ``TEST_REUSE_GALLERY=1`` to start from the repository's own
    ``auto_tutorials/`` (Sphinx-Gallery's cache) when iterating locally.
    """
    result = _background[0].result() if _background else build(_real_site_sources(tmp_path_factory))
    assert result.returncode == 0, f"the real site failed to build:\n{result.log[-20000:]}"
    return result


@pytest.fixture(scope="session")
def fixture_site(tmp_path_factory) -> Build:
    """A two-page site built with the real configuration."""
    src = make_site(
        tmp_path_factory.mktemp("fixture") / "site",
        tutorials=sorted((FIXTURES / "tutorials").glob("*.py")),
    )
    result = build(src)
    assert result.returncode == 0, result.log[-10000:]
    return result
