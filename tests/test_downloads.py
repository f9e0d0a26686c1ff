"""What a reader downloads runs: each tutorial's ``.py`` with plain ``python``
and its ``.ipynb`` with ``nbclient`` on a fresh kernel, on CPU, outside the
Sphinx build.

Both runs use ``TUTORIALS_QUICK=1`` (smaller sizes, every assertion kept) and
``TUTORIALS_DTYPE=bfloat16``: the pages' CUDA dtype on a CPU, so every
low-precision path and tolerance runs here, while the site build runs every
page in float32 at full size. Each page thus runs three times in the suite,
and in both dtypes. Each download is copied alone into an empty folder and
run there, with no ``PYTHONPATH``: the toolkit module the pages import must
come from the download itself (the .py carries it, the notebook's second
cell writes it), never from the repository. The two runs
are also the reproducibility check: they must print the same lines (sequence
lengths, token counts, correctness figures), except lines that report a
timing, a speed or a memory figure. Within the lines compared, decimal
numbers (timing tables print ratios and milliseconds without a unit on the
row) are masked; integers (lengths, token counts, ids) and numbers in
scientific notation (the correctness figures, such as a maximum difference
of 4.8e-07) must match exactly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from urllib.parse import unquote

import nbformat
import pytest
from nbclient import NotebookClient

from pages import soup
from sitebuild import FIXTURES, STEMS, Build, build, make_site
from test_real_site import notebook_problems, toolkit_wheel

pytestmark = [pytest.mark.notebook, pytest.mark.lowprecision]

QUICK_ENV = {"TUTORIALS_QUICK": "1", "TUTORIALS_DTYPE": "bfloat16", "MPLBACKEND": "agg",
             "PYTHONWARNINGS": "ignore::DeprecationWarning"}
TIMEOUT_S = 600

# A line that reports something measured (time, speed, memory), or a choice
# or a verdict a page makes from such a measurement ("chosen ...", "decoding
# with ...", "... within noise"), may differ between two runs; every other
# line must be identical.
MEASURED = re.compile(
    r"\b(ms|us|µs|ns|s|sec|seconds|tokens/s|tok/s|it/s|MB|MiB|GB|GiB|KB|KiB|bytes)\b"
    r"|speedup|faster|slower|median|IQR|fraction|throughput|\d+(\.\d+)?x\b|time|memory|peak"
    r"|chosen|decoding with|noise"
    # a kernel label on a line of its own or after "kernels:", and the ranking
    # of the paths that follow the measured choice ("then: ..."): all follow
    # from timings
    r"|^\s*\[[^\]]*\]\s*$|^\s*then:|^\s*kernels:"
    # and a rule the decision guide draws from this build's timings ("inference
    # on CPU: use loop; if ..."): the cited rules of the other device stay compared
    r"| on (CPU|CUDA): use ",
    re.I)


DECIMAL = re.compile(r"\d+\.\d+(?![\deE])")


def comparable(text: str) -> list[str]:
    # Column alignment follows the width of the masked numbers: collapse it.
    return [" ".join(DECIMAL.sub("#", ln).split()) for ln in text.splitlines()
            if ln.strip() and not MEASURED.search(ln)]


def downloaded(site, stem: str, suffix: str) -> Path:
    hits = list((site.html / "_downloads").rglob(stem + suffix))
    assert len(hits) == 1, f"{stem}{suffix}: {hits}"
    return hits[0]


def alone(download: Path, folder: Path) -> Path:
    """``download`` copied into the empty ``folder``: nothing beside it."""
    folder.mkdir()
    return Path(shutil.copy2(download, folder / download.name))


def without_toolkit(folder: Path) -> Path:
    """The python of a new virtual environment that sees this environment's
    packages (a path file naming its site-packages) but not what their own
    path files add, such as the editable install of the toolkit."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def run_alone(site, stem: str, tmp_path: Path, monkeypatch, env: dict[str, str]):
    """The page's downloaded .py (plain python) alone in an empty folder, and
    its notebook (a fresh kernel) in a folder with what its zip holds, both
    where the toolkit is not installed, with no PYTHONPATH; returns the
    script's process, the executed notebook and that environment's python."""
    clean = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "PYTHONPATH")}
    python = without_toolkit(tmp_path / "env")
    probe = subprocess.run([str(python), "-c", "import torch, ragged_toolkit"], cwd=tmp_path,
                           env=clean, capture_output=True, text=True)
    assert "No module named 'ragged_toolkit'" in probe.stderr, "the toolkit is importable: the test proves nothing"

    # The script runs while the notebook runs (each mostly on one core).
    script = alone(downloaded(site, stem, ".py"), tmp_path / "py")
    running = subprocess.Popen([str(python), script.name], cwd=script.parent, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**clean, **env})

    # The notebook, on a fresh kernel of that environment, in the page's zip
    # unpacked: the notebook and the toolkit's wheel (and the .py).
    folder = tmp_path / "nb"
    with zipfile.ZipFile(downloaded(site, stem, ".zip")) as zf:
        zf.extractall(folder)
    kernels = tmp_path / "jupyter" / "kernels" / "without-toolkit"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "without the toolkit", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    notebook = folder / f"{stem}.ipynb"
    nb = nbformat.read(notebook, as_version=4)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    try:
        NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="without-toolkit",
                       resources={"metadata": {"path": str(folder)}}).execute()
        stdout, stderr = running.communicate(timeout=TIMEOUT_S)
    finally:
        running.kill()
    proc = subprocess.CompletedProcess(running.args, running.returncode, stdout, stderr)
    assert proc.returncode == 0, f"{stem}.py failed, alone in a folder:\n{proc.stderr[-5000:]}"
    assert [p.name for p in script.parent.iterdir()] == [script.name], f"{stem}.py wrote beside itself"
    installed = subprocess.run([str(python), "-c", "import ragged_toolkit; print(ragged_toolkit.__file__)"],
                               cwd=tmp_path, capture_output=True, text=True, env=clean)
    assert str(tmp_path / "env") in installed.stdout, f"{stem}.ipynb did not install the toolkit: {installed}"
    return proc, nb


@pytest.mark.parametrize("stem", STEMS)
def test_downloaded_py_and_notebook_run_and_agree(real_site, stem, tmp_path, monkeypatch):
    proc, nb = run_alone(real_site, stem, tmp_path, monkeypatch, QUICK_ENV)
    script = downloaded(real_site, stem, ".py")
    assert "dtype: torch.bfloat16" in proc.stdout, f"{stem}.py did not pick up TUTORIALS_DTYPE"
    first = next(c for c in nb.cells if c.cell_type == "code")
    pip_out = "".join(o.get("text", "") for o in first.outputs)
    assert "error" not in pip_out.lower(), f"{stem}: the install cell failed:\n{pip_out}"
    printed = "".join(
        o.get("text", "")
        for c in nb.cells if c.cell_type == "code" and c is not first
        for o in c.outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")

    a, b = comparable(proc.stdout), comparable(printed)
    assert a, f"{stem}: printed nothing comparable"
    assert a == b, (f"{stem}: the .py and the notebook printed different figures:\n"
                    + "\n".join(f"py: {x}\nnb: {y}" for x, y in zip(a, b) if x != y)[:3000])

    # A reader running the .py in a terminal sees only what the page prints:
    # not kineto's "USDT ... profiler_start/stop" lines (a page that profiles
    # sets KINETO_LOG_LEVEL=6 before its first torch.profiler use). Checked
    # last, so that the comparison above runs for every page.
    usdt = [ln for ln in proc.stderr.splitlines() if "USDT" in ln]
    if usdt and "KINETO_LOG_LEVEL" not in script.read_text():
        pytest.xfail(f"{stem}.py prints {len(usdt)} USDT lines: the page must set "
                     "KINETO_LOG_LEVEL=6 before profiling (pending in the tutorial sources)")
    assert not usdt, f"{stem}.py printed profiler noise on stderr: {usdt[:2]}"


# --- a one-page site that uses the toolkit and the rST a notebook cannot show ----

@pytest.fixture(scope="module")
def toolkit_site(tmp_path_factory) -> Build:
    src = make_site(tmp_path_factory.mktemp("downloads") / "site",
                    tutorials=[FIXTURES / "downloads" / "uses_toolkit.py"])
    result = build(src)
    assert result.returncode == 0, result.log[-10000:]
    return result


def test_fixture_downloads_run_alone_and_the_notebook_reads_as_the_page(toolkit_site, tmp_path, monkeypatch):
    proc, nb = run_alone(toolkit_site, "uses_toolkit", tmp_path, monkeypatch, {"MPLBACKEND": "agg"})
    assert "offsets: [0, 3, 4, 8]" in proc.stdout
    outputs = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells if c.cell_type == "code"]
    assert "offsets: [0, 3, 4, 8]" in outputs[-1], outputs

    assert not notebook_problems(nb), notebook_problems(nb)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    site = "https://ragged-transformers.github.io/tutorials/"
    for made in ("**What you will learn**\n\n* That a downloaded page runs alone",  # grid and cards
                 f"A [ragged batch]({site}auto_tutorials/uses_toolkit.html#term-ragged-batch) is packed",  # :term:
                 f"more on\n[this page]({site}auto_tutorials/uses_toolkit.html",  # :ref:
                 f"[the gallery]({site}auto_tutorials/index.html)",  # :doc:
                 "```python\ndef offsets_from_lengths(",  # literalinclude :pyobject:
                 "**ragged batch**\n\nSequences of different lengths"):  # glossary
        assert made in text, f"not in the notebook: {made!r}"
    assert "fixture-only" not in text and "octicon" not in text and "currentmodule" not in text  # dropped

    # The side bar and the footer each link the toolkit's wheel.
    html = toolkit_site.html / "auto_tutorials" / "uses_toolkit.html"
    for selector in (".sphx-glr-footer", ".tutorial-toolkit"):
        links = [a["href"] for a in soup(html).select(f"{selector} a.tutorial-toolkit-link")]
        wheel = (html.parent / unquote(links[0])).resolve() if len(links) == 1 else None
        assert wheel is not None and wheel.read_bytes() == toolkit_wheel(toolkit_site), (selector, links)
