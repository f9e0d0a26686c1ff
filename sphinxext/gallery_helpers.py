"""Callables the Sphinx-Gallery build uses, kept out of ``conf.py``.

``conf.py`` names these; they do four jobs:

* ``reset_state``: runs before and after every tutorial, so that nothing one
  page changes (seeds, default dtype or device, dynamo caches and config,
  matplotlib settings, warning filters) leaks into the next one. Before a page
  it also records which PyTorch and which device produced its figures, and
  arms a per-tutorial time limit.
* ``PeakMemory``: the memory figure Sphinx-Gallery prints under each page
  (it subtracts the reading taken just before the page starts). With CUDA it
  is ``torch.cuda.max_memory_allocated``; on CPU, where PyTorch keeps no
  allocator statistics, it is the peak resident set size of the build
  process, sampled every 5 ms.
* ``add_environment_stamp``: puts that record at the top of each page.
* ``strip_remote_assets``: keeps CDN scripts off the computation-times pages.
* ``write_landing_cards``: the landing page's card grid, one card per
  tutorial, generated so that no tutorial can be left off it.
"""

from __future__ import annotations

import ast
import atexit
import json
import logging
import os
import platform
import random
import re
import signal
import sys
import threading
import warnings
from pathlib import Path

GALLERY_SRC = "tutorials"
GALLERY_OUT = "auto_tutorials"
STAMP_SUFFIX = ".env.json"

# A tutorial that runs longer than this is stopped and fails the build.
TIME_LIMIT_ENV = "TUTORIAL_TIME_LIMIT_S"
DEFAULT_TIME_LIMIT_S = 900

_baseline: dict = {}
# The tutorial being executed, if any: set before it runs, cleared after.
_running: str | None = None


def _exit_guard() -> None:
    """If the interpreter exits while a tutorial is running, that tutorial
    called ``sys.exit`` (or ``exit()``) and took the whole build down with it,
    and Sphinx would report success. Turn that into a failure that names it."""
    if _running is not None:
        sys.stdout.flush()
        print(f"\nerror: the tutorial {_running} ended the build half-way "
              "(it called sys.exit or raised SystemExit); the site is incomplete.",
              file=sys.stderr, flush=True)
        os._exit(1)


atexit.register(_exit_guard)


class TutorialTimeout(Exception):
    """Raised inside a tutorial that ran past the per-tutorial time limit."""


def _time_limit_s() -> int:
    raw = os.environ.get(TIME_LIMIT_ENV, str(DEFAULT_TIME_LIMIT_S))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{TIME_LIMIT_ENV} must be a whole number of seconds, got {raw!r}") from None


def _on_alarm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise TutorialTimeout(
        f"tutorial ran past the per-tutorial limit of {_time_limit_s()} s "
        f"(set {TIME_LIMIT_ENV} to change it)"
    )


def describe_device() -> dict:
    """What produced a page's figures: PyTorch version and device."""
    import torch

    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["memory"] = "peak CUDA memory allocated (torch.cuda.max_memory_allocated)"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        info["device"] = f"CPU, {cores} cores"
        info["memory"] = ("peak growth of the build process's resident memory (RSS) "
                          "while the page ran, sampled every 5 ms")
    return info


def _snapshot_baseline() -> None:
    """Remember the process-wide state as it was before the first tutorial."""
    if _baseline:
        return
    import torch

    _baseline["warning_filters"] = list(warnings.filters)
    _baseline["dynamo_config"] = torch._dynamo.config.save_config()
    _baseline["inductor_config"] = torch._inductor.config.save_config()
    _baseline["num_threads"] = torch.get_num_threads()
    _baseline["matmul_precision"] = torch.get_float32_matmul_precision()
    _baseline["loggers"] = {
        name: list(logger.filters)
        for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }


def _restore_state() -> None:
    import numpy as np
    import torch

    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    torch.set_grad_enabled(True)
    torch.set_num_threads(_baseline["num_threads"])
    torch.set_float32_matmul_precision(_baseline["matmul_precision"])
    torch.use_deterministic_algorithms(False)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        # Loading a saved config also sets its deprecated keys, which warns.
        warnings.simplefilter("ignore", FutureWarning)
        torch._dynamo.config.load_config(_baseline["dynamo_config"])
        torch._inductor.config.load_config(_baseline["inductor_config"])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    warnings.filters[:] = _baseline["warning_filters"]
    warnings._filters_mutated()  # noqa: SLF001 - invalidate the per-module caches
    for name, logger in logging.root.manager.loggerDict.items():
        if isinstance(logger, logging.Logger):
            logger.filters[:] = _baseline["loggers"].get(name, [])

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)

    import matplotlib
    import matplotlib.pyplot as plt

    plt.close("all")
    matplotlib.rcdefaults()
    matplotlib.use("agg")


def stamp_path(src_dir: str | Path, fname: str) -> Path:
    return Path(src_dir) / GALLERY_OUT / (Path(fname).stem + STAMP_SUFFIX)


def reset_state(gallery_conf, fname, when):
    """Sphinx-Gallery ``reset_modules`` callable (order "both")."""
    global _running
    _snapshot_baseline()
    if when == "before":
        _restore_state()
        if fname is not None:
            _running = str(Path(GALLERY_SRC) / fname)
            path = stamp_path(gallery_conf["src_dir"], fname)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(describe_device(), indent=1, sort_keys=True) + "\n")
            signal.signal(signal.SIGALRM, _on_alarm)
            signal.alarm(_time_limit_s())
    else:
        signal.alarm(0)
        _running = None
        _restore_state()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Sphinx-Gallery ``show_memory`` callable: returns (MB, func's result).

    A class instance rather than a function so that Sphinx can pickle the
    configuration that holds it.
    """

    def __repr__(self):
        return "gallery_helpers.PeakMemory()"

    def __call__(self, func):
        return _peak_memory(func)


def _peak_memory(func):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = func()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20, out

    peak = [_rss_bytes()]
    done = threading.Event()

    def sample():
        while not done.wait(0.005):
            peak[0] = max(peak[0], _rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = func()
    finally:
        done.set()
        sampler.join()
    peak[0] = max(peak[0], _rss_bytes())
    return peak[0] / 2**20, out


def add_environment_stamp(app, docname, source):
    """``source-read`` hook: a note under the title of each tutorial page."""
    prefix = GALLERY_OUT + "/"
    if not docname.startswith(prefix) or docname.endswith("index") or "sg_execution" in docname:
        return
    stem = docname[len(prefix):]
    path = stamp_path(app.srcdir, stem + ".py")
    if not path.exists():
        # Built without executing (html-noplot): no figures to vouch for.
        text = "This page was built without running its code, so it shows no figures."
    else:
        info = json.loads(path.read_text())
        text = (
            f"The figures on this page were produced while the site was built, "
            f"with PyTorch {info['torch']} on {info['device']} "
            f"(Python {info['python']}). The memory figure at the end is the "
            f"{info['memory']}."
        )
    note = f"\n.. admonition:: Built with\n   :class: build-stamp\n\n   {text}\n\n"
    content = source[0]
    # Insert right after the page title (the first "===" underline).
    m = re.search(r"^(.+)\n(=+)\n", content, flags=re.M)
    if m is None:
        source[0] = note + content
    else:
        source[0] = content[: m.end()] + note + content[m.end():]


_REMOTE_RAW = re.compile(r"^(?P<i>[ ]*)\.\. raw:: html\n(?:\n|(?P=i)[ ]+.*\n)*", re.M)


def strip_remote_assets(app, docname, source):
    """``source-read`` hook: Sphinx-Gallery's computation-times pages load
    jQuery and DataTables from CDNs to make their table sortable. A page of
    this site loads nothing from other hosts, so the plain table stays."""
    if docname.endswith("sg_execution_times"):
        source[0] = _REMOTE_RAW.sub(
            lambda m: m.group(0) if "https://" not in m.group(0) else "", source[0])


# --- landing page -----------------------------------------------------------

# The order a reader should take the tutorials in; a new file not listed
# here comes after these, by name.
READING_ORDER = [
    "ragged_batches_intro",
    "transformer_building_blocks",
    "transformer_layers_for_ragged_batches",
    "ragged_decoding_kv_cache_gqa",
]


def reading_order_key(stem: str):
    return (READING_ORDER.index(stem), "") if stem in READING_ORDER else (len(READING_ORDER), stem)


class TutorialOrder:
    """Sphinx-Gallery ``within_subsection_order``: the reading order above."""

    def __init__(self, src_dir):
        self.src_dir = src_dir

    def __repr__(self):
        return "gallery_helpers.TutorialOrder"

    def __call__(self, filename):
        return reading_order_key(Path(filename).stem)


_TAGS = re.compile(r"^#\s*sphinx_gallery_tags\s*=\s*(\[.*\])\s*$", re.M)


def tutorial_card_info(path: Path) -> dict:
    """Title, one-line description and tags of a tutorial source file."""
    text = path.read_text()
    doc = ast.get_docstring(ast.parse(text)) or ""
    lines = doc.strip().splitlines()
    if len(lines) < 2 or not re.fullmatch(r"=+", lines[1].strip()):
        raise ValueError(f"{path}: the docstring must open with a title underlined by '='")
    title = lines[0].strip()
    paragraphs = re.split(r"\n\s*\n", "\n".join(lines[2:]))
    description = ""
    for para in paragraphs:
        para = " ".join(para.split())
        if para and not para.startswith(("**", "..", ":")):
            description = para
            break
    if not description:
        raise ValueError(f"{path}: no summary paragraph after the title")
    first_sentence = re.match(r"(.+?[.!?])(\s|$)", description)
    if first_sentence:
        description = first_sentence.group(1)
    m = _TAGS.search(text)
    tags = ast.literal_eval(m.group(1)) if m else []
    return {"stem": path.stem, "title": title, "description": description, "tags": tags}


def landing_cards_rst(src_dir: Path) -> str:
    out = [".. grid:: 1 2 2 3", "   :gutter: 3", ""]
    for path in sorted((src_dir / GALLERY_SRC).glob("*.py"), key=lambda p: reading_order_key(p.stem)):
        card = tutorial_card_info(path)
        thumb = f"/{GALLERY_OUT}/images/thumb/sphx_glr_{card['stem']}_thumb.png"
        out += [
            f"   .. grid-item-card:: {card['title']}",
            f"      :link: {GALLERY_OUT}/{card['stem']}",
            "      :link-type: doc",
            f"      :img-top: {thumb}",
            f"      :img-alt: Thumbnail of {card['title']}",
            "      :class-card: tutorial-card",
            "",
            f"      {card['description']}",
            "",
        ]
        if card["tags"]:
            out += ["      " + " ".join(f":bdg-secondary:`{t}`" for t in card["tags"]), ""]
    return "\n".join(out) + "\n"


def write_landing_cards(app):
    """``builder-inited`` hook (after Sphinx-Gallery): ``_generated/cards.rst``."""
    src_dir = Path(app.srcdir)
    target = src_dir / "_generated" / "cards.rst"
    target.parent.mkdir(exist_ok=True)
    text = landing_cards_rst(src_dir)
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
