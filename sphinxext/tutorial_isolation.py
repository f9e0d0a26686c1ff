"""Every tutorial runs in a process of its own; what its code blocks run through.

:func:`run_each_tutorial_in_its_own_process` wraps Sphinx-Gallery's
``generate_file_rst`` (it has no hook for this; the PyTorch tutorials do the
same): a tutorial that is to run is generated, code and page, in a fork of
the build (Linux, no CUDA context in the build) or a fresh interpreter
(elsewhere, or ``TUTORIALS_START_METHOD=spawn``), seeded and stamped first.
The process ends with everything it started (its process group), so no
state of one tutorial reaches the next; it sends back what
``generate_file_rst`` returns, which the build records as before. Past the
time limit it is killed after ``faulthandler`` wrote its stack; one killed
or ended without an answer fails its page, named, with its line, and runs
again at the next build. :class:`PeakMemory` (``show_memory``) gives the
process's own peak memory. A ``sys.exit`` fails its page, named, with its line.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import logging
import multiprocessing
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from textwrap import indent

import page_parts

START_METHOD_ENV = "TUTORIALS_START_METHOD"
TIME_LIMIT_ENV = "TUTORIAL_TIME_LIMIT_S"


def use_private_compile_cache() -> None:
    """Unless the caller chose a cache, the tutorials' processes compile into
    a folder made for this build, empty when it began, removed at its end."""
    if any(os.environ.get(v) for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")):
        os.environ.setdefault("TUTORIALS_COMPILE_CACHE", "chosen")
    else:
        cache = Path(tempfile.mkdtemp(prefix="tutorials-compile-cache-"))
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        os.environ.update(TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"),
                          TUTORIALS_COMPILE_CACHE="build")


def time_limit_s() -> float:
    raw = os.environ.get(TIME_LIMIT_ENV, "900")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{TIME_LIMIT_ENV} must be a number of seconds, got {raw!r}") from None


def start_method() -> str:
    """``fork`` where it is safe, else ``spawn``."""
    torch = sys.modules.get("torch")
    cuda_context = torch is not None and torch.cuda.is_initialized()
    return os.environ.get(START_METHOD_ENV) or ("fork" if sys.platform == "linux" and not cuda_context
                                                else "spawn")


# --- one call in a process of its own ------------------------------------------

@dataclass
class Ended:
    """How a call in its own process ended."""

    answered: bool = False  # it returned or raised (else: killed, or ended without an answer)
    value: object = None  # what it returned
    raised: BaseException | None = None  # what it raised
    failure: str | None = None  # why its page failed outside its code, naming the tutorial
    stack: str = ""  # its Python stack when it was stopped or crashed, if written
    warnings: int = 0  # Sphinx warnings it logged (not its page's own failure)
    seconds: float = 0.0


def _child(sender, target, args, stack_path, name, src_file):
    os.setpgrp()  # what the call starts ends with it (killpg below)
    if sys.platform == "linux":  # and it ends if the build is killed (PR_SET_PDEATHSIG)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    stack_file = open(stack_path, "w")  # noqa: SIM115 - open until os._exit
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    sphinx_logger = logging.getLogger("sphinx")
    if not sphinx_logger.handlers:  # spawn: no Sphinx logging set up here
        sphinx_logger.addHandler(logging.StreamHandler(sys.stderr))
    warnings = []  # Sphinx-Gallery records a failing page itself: not counted
    counter = logging.Handler(logging.WARNING)
    counter.emit = lambda r: warnings.append(1) if getattr(r, "subtype", None) != "example_error" else None
    sphinx_logger.addHandler(counter)
    try:
        answer = ("returned", target(*args))
    except Exception as exc:  # noqa: BLE001 - all of it goes to the build
        answer = ("raised", exc)
    except BaseException as exc:  # noqa: BLE001 - sys.exit and the like: Sphinx-Gallery catches Exception only
        at = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if os.path.normpath(f.filename) == src_file]
        at = f" at line {at[-1]}" if at else ""  # the tutorial's innermost line
        answer = ("failed", f"{name} called sys.exit({exc.code!r}) (or raised SystemExit){at}: a tutorial must "
                            "not end the build; raise an exception instead" if isinstance(exc, SystemExit)
                  else f"{name}: raised {exc!r}{at}")
    sender.send((*answer, len(warnings)))  # what does not pickle ends it with a traceback, as a crash
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no atexit handler of the build, no join of the call's threads


def _stack(path: str, src_file: str) -> tuple[str, int | None]:
    """From what faulthandler wrote: the first thread's stack in the tutorial's
    code (the one stopped or crashed is listed first), down to the tutorial's
    outermost frame, and the tutorial's innermost line."""
    text = Path(path).read_text(errors="replace") if Path(path).exists() else ""
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text):
        lines = [ln for ln in block.splitlines() if re.match(r"(Current thread|Thread) 0x|  File ", ln)]
        ours = [i for i, ln in enumerate(lines)
                if (m := re.match(r'  File "(.*)", line (\d+)', ln)) and os.path.normpath(m[1]) == src_file]
        if ours:
            return "\n".join(lines[: ours[-1] + 1]), int(re.search(r"line (\d+)", lines[ours[0]])[1])
    return text.strip(), None


_SIGNAL_HINTS = {"SIGSEGV": " (a segmentation fault)", "SIGABRT": " (aborted)",
                 "SIGKILL": " (from outside the build: the out-of-memory killer, or a person)"}


def run_isolated(target, args, *, name: str, src_file: str, limit_s: float, method: str | None = None) -> Ended:
    """``target(*args)`` in a process of its own, killed after ``limit_s``.
    ``name`` ("tutorials/x.py") and ``src_file`` (its path) are what a
    failure names."""
    ctx = multiprocessing.get_context(method or start_method())
    fd, stack_path = tempfile.mkstemp(prefix="tutorial-stack-", suffix=".txt")
    os.close(fd)
    receiver, sender = ctx.Pipe(duplex=False)
    src_file = os.path.normpath(src_file)
    proc = ctx.Process(target=_child, args=(sender, target, args, stack_path, name, src_file),
                       name=f"tutorial {name}")
    ended, timed_out, start = Ended(), False, time.monotonic()
    try:
        proc.start()
        sender.close()
        ready = wait([receiver, proc.sentinel], timeout=limit_s)
        if receiver in ready:
            try:
                kind, value, ended.warnings = receiver.recv()
                setattr(ended, {"returned": "value", "raised": "raised", "failed": "failure"}[kind], value)
                ended.answered = True
            except EOFError:  # it ended without an answer
                pass
        elif not ready:
            timed_out = True
            os.kill(proc.pid, signal.SIGUSR1)  # faulthandler writes its stack ...
            proc.join(1.0)
            proc.kill()  # ... and it ends
        proc.join()
    finally:
        for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
            try:
                kill()
            except OSError:  # already gone
                pass
        receiver.close()
        ended.seconds = time.monotonic() - start
        ended.stack, line = _stack(stack_path, src_file)
        os.unlink(stack_path)
    at, code = ("" if line is None else f" at line {line}"), proc.exitcode
    if ended.answered:
        pass
    elif timed_out:
        ended.failure = (f"{name} ran past the per-tutorial limit of {limit_s:g} s{at} (set "
                         f"{TIME_LIMIT_ENV} to change it); its process was killed")
    elif code is not None and code < 0:
        sig = signal.Signals(-code).name
        ended.failure = f"{name}: its process was killed by {sig}{_SIGNAL_HINTS.get(sig, '')}{at}"
    else:
        ended.failure = (f"{name}: its process ended with exit status {code}{at} before its page was "
                         "written (os._exit, or a crash)")
    return ended


# --- Sphinx-Gallery's pages ------------------------------------------------------

def _run_page(fname, target_dir, src_dir, gallery_conf):
    """In the tutorial's process: its page, as Sphinx-Gallery generates it
    (it runs the code only if the page changed and the pattern matches it)."""
    import inspect

    from sphinx_gallery import gen_rst

    _page.update(src_dir=gallery_conf["src_dir"], fname=fname)
    return inspect.unwrap(gen_rst.generate_file_rst)(fname, target_dir, src_dir, gallery_conf)


def _failed_page(fname, target_dir, src_file, gallery_conf, name, ended):
    """Record a tutorial whose process ended without an answer as a failing
    example, with a page that says why."""
    from sphinx.util import logging as sphinx_logging
    from sphinx_gallery import gen_rst

    target_dir, stem = Path(target_dir), Path(fname).stem
    Path(target_dir, Path(fname).name + ".md5").unlink(missing_ok=True)  # it runs again next time
    file_conf, blocks = gen_rst._get_parser(fname, gallery_conf)[0].split_code_and_text_blocks(src_file)[:2]
    intro, title = gen_rst.extract_intro_and_title(fname, blocks[0].content)
    report = (f"Its Python stack at the end:\n{ended.stack}\n\n" if ended.stack else "") + ended.failure
    label = Path(os.path.relpath(target_dir / fname, gallery_conf["src_dir"])).as_posix().replace("/", "_")
    (target_dir / f"{stem}.rst").write_text(
        f".. _sphx_glr_{label}:\n\n{title}\n{'=' * len(title)}\n\n"
        "This page's code did not run to the end:\n\n"
        f".. rst-class:: sphx-glr-script-out\n\n.. code-block:: none\n\n{indent(report, '    ')}\n",
        encoding="utf-8")
    gen_rst.save_thumbnail(str(target_dir / "images" / f"sphx_glr_{stem}_{{0:03}}.png"), src_file,
                           {"formatted_exception": report}, {}, gallery_conf)
    sphinx_logging.getLogger(__name__).warning(
        "\n%s unexpectedly failed to execute correctly:\n\n%s", name, indent(report, "    "),
        type="sphinx_gallery", subtype="example_error")
    out_vars = {"formatted_exception": report, **({"tags": file_conf["tags"]} if "tags" in file_conf else {})}
    return intro, title, (ended.seconds, 0.0), out_vars


def run_each_tutorial_in_its_own_process() -> None:
    """Wrap Sphinx-Gallery's ``generate_file_rst`` (once)."""
    from sphinx.util import logging as sphinx_logging
    from sphinx_gallery import gen_rst

    original = gen_rst.generate_file_rst
    if getattr(original, "in_own_process", False):
        return

    @functools.wraps(original)
    def generate_file_rst(fname, target_dir, src_dir, gallery_conf):
        src_file = os.path.normpath(Path(src_dir, fname))
        name = Path(os.path.relpath(src_file, gallery_conf["src_dir"])).as_posix()
        ended = run_isolated(_run_page, (fname, target_dir, src_dir, gallery_conf),
                             name=name, src_file=src_file, limit_s=time_limit_s())
        if ended.warnings:
            sphinx_logging.getLogger(__name__).warning(
                "%s: %d warning(s) while its page was generated (above)", name, ended.warnings)
        if ended.raised is not None:
            raise ended.raised
        if ended.failure is not None:
            return _failed_page(fname, target_dir, src_file, gallery_conf, name, ended)
        return ended.value

    generate_file_rst.in_own_process = True
    gen_rst.generate_file_rst = generate_file_rst


# --- what every code block runs through --------------------------------------------

CLEAR_REFS = "/proc/self/clear_refs"  # "5" starts the peak afresh (Linux)
_page: dict = {}  # in a tutorial's process: its src_dir and fname, until its code begins


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB: ``VmHWM`` on Linux (what
    :class:`PeakMemory` starts afresh; ``ru_maxrss`` also keeps a spawning build's peak)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 2**10
    except (OSError, StopIteration):
        import resource  # not on Windows, which the build does not support

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB elsewhere


class PeakMemory:
    """Sphinx-Gallery ``show_memory`` callable: returns (MiB, func's result).
    An instance, not a function, so that Sphinx can pickle the configuration."""

    def __repr__(self):
        return "tutorial_isolation.PeakMemory()"

    def __call__(self, func):
        import torch

        if _page:  # Sphinx-Gallery's empty call before the first block: seed, stamp, start the peak afresh
            import numpy as np

            torch.manual_seed(0)
            np.random.seed(0)
            random.seed(0)
            src_dir, fname = _page.pop("src_dir"), _page.pop("fname")
            page_parts.record_environment(src_dir, fname)
            page_parts.start_figure_records(src_dir, fname)
            try:
                with open(CLEAR_REFS, "w") as f:
                    f.write("5")
            except OSError:
                pass
        out = func()
        if torch.cuda.is_available():  # the allocator's own count: no synchronize needed
            return torch.cuda.max_memory_allocated() / 2**20, out
        return peak_rss_mb(), out
