from __future__ import annotations

import os
import shutil

import pytest

from sitebuild import FIXTURES, REPO, Build, build, make_site


def pytest_report_header(config):
    return f"site sources: {REPO}"


@pytest.fixture(scope="session")
def real_site(tmp_path_factory) -> Build:
    """The real site, built once per test session from a clean copy.

    Set ``TEST_REUSE_GALLERY=1`` to start from the repository's own
    ``auto_tutorials/`` (Sphinx-Gallery's cache) when iterating locally.
    """
    src = make_site(tmp_path_factory.mktemp("real") / "site")
    cached = REPO / "auto_tutorials"
    if os.environ.get("TEST_REUSE_GALLERY") == "1" and cached.is_dir():
        shutil.copytree(cached, src / "auto_tutorials")
    result = build(src)
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
