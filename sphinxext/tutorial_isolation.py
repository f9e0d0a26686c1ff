"""Every tutorial runs in a process of its own.

``conf.py`` calls :func:`run_each_tutorial_in_its_own_process`, which wraps
Sphinx-Gallery's ``generate_file_rst`` (it has no hook for this; the PyTorch
tutorials do the same): each tutorial that is to run is generated, code and
page, in a process started from the build, a fork where that is safe
(Linux, no CUDA context in the build process), a fresh interpreter
(``spawn``, or ``TUTORIALS_START_METHOD=spawn``) elsewhere. That process
writes what Sphinx-Gallery writes (page, images, notebook, MD5 and cost
records) and sends back what ``generate_file_rst`` returns, which the build
records as before (gallery index, execution times, JUnit). It ends with
everything it started (its process group), so no setting, thread, signal
handler, module, compile cache or allocator of one tutorial reaches the
next. Before the code runs it seeds torch, numpy and ``random`` with 0 and
records the page stamp. Unless the caller chose a compile cache, the pages
compile into the build's own inductor and Triton cache, empty when the build
began (:func:`use_private_compile_cache`): it holds compiled kernels, keyed
by what they compute, and no state of a page.

The build keeps the time limit (``TUTORIAL_TIME_LIMIT_S``, default 900 s)
from outside: past it, the process's Python stack is written
(``faulthandler``) and the process is killed. One that is killed or ends
without an answer (the limit, ``os._exit``, a segmentation fault, the
out-of-memory killer) fails its page, named, with the line where its stack
shows one; its page says why, and its MD5 is removed so that it runs again.
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
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from textwrap import indent

from sphinx.util import logging as sphinx_logging

import tutorial_memory

logger = sphinx_logging.getLogger("tutorial_isolation")

COMPILE_CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
START_METHOD_ENV = "TUTORIALS_START_METHOD"
TIME_LIMIT_ENV = "TUTORIAL_TIME_LIMIT_S"
_private_cache: list[Path] = []  # the build's compile cache


def use_private_compile_cache() -> None:
    """Unless the caller chose a cache, the tutorials' processes compile into
    a folder made for this build, empty when it began, removed at its end."""
    if any(os.environ.get(v) for v in COMPILE_CACHE_VARS):
        os.environ.setdefault("TUTORIALS_COMPILE_CACHE", "chosen")
    elif not _private_cache:
        _private_cache.append(Path(tempfile.mkdtemp(prefix="tutorials-compile-cache-")))
        atexit.register(shutil.rmtree, _private_cache[0], ignore_errors=True)
        os.environ["TUTORIALS_COMPILE_CACHE"] = "build"


def time_limit_s() -> float:
    raw = os.environ.get(TIME_LIMIT_ENV, "900")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{TIME_LIMIT_ENV} must be a number of seconds, got {raw!r}") from None


def start_method() -> str:
    """``fork`` where it is safe, else ``spawn``."""
    chosen = os.environ.get(START_METHOD_ENV)
    if chosen:
        return chosen
    torch = sys.modules.get("torch")
    cuda_context = torch is not None and torch.cuda.is_initialized()
    return "fork" if sys.platform == "linux" and not cuda_context else "spawn"


# --- one call in a process of its own ------------------------------------------

@dataclass
class Ended:
    """How a call in its own process ended."""

    answered: bool = False  # it returned or raised (else: killed, or ended without an answer)
    value: object = None  # what it returned
    raised: BaseException | None = None  # what it raised
    failure: str | None = None  # why it ended without an answer, naming the tutorial
    stack: str = ""  # its Python stack when it was stopped or crashed, if written
    warnings: int = 0  # Sphinx warnings it logged (not its page's own failure)
    seconds: float = 0.0


class _WarningCount(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record):
        # Sphinx-Gallery records a failing page itself.
        self.n += getattr(record, "subtype", None) != "example_error"


def _child(sender, target, args, stack_path):
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # what the call starts ends with it (killpg below)
    if sys.platform == "linux":  # and it ends if the build is killed (PR_SET_PDEATHSIG)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    stack_file = open(stack_path, "w")  # noqa: SIM115 - open until os._exit
    stack_file.write(f"main thread 0x{threading.get_ident():x}\n")
    stack_file.flush()
    faulthandler.enable(file=stack_file, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    sphinx_logger = logging.getLogger("sphinx")
    if not sphinx_logger.handlers:  # spawn: no Sphinx logging set up here
        sphinx_logger.addHandler(logging.StreamHandler(sys.stderr))
    count = _WarningCount()
    sphinx_logger.addHandler(count)
    try:
        answer = ("returned", target(*args))
    except BaseException as exc:  # noqa: BLE001 - all of it goes to the build
        answer = ("raised", exc)
    try:
        sender.send((*answer, count.n))
    except Exception:  # noqa: BLE001 - what it returned or raised does not pickle
        text = "".join(traceback.format_exception(answer[1])) if answer[0] == "raised" else repr(answer[1])
        sender.send(("raised", RuntimeError(f"{answer[0]} what cannot be pickled:\n{text}"), count.n))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no atexit handler of the build, no join of the call's threads


def _kill_group(proc) -> None:
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (AttributeError, OSError):  # no process groups (Windows); already gone
            pass


def _stack(path: str, src_file: str) -> tuple[str, int | None]:
    """From what faulthandler wrote: the main thread's stack, down to the
    tutorial's outermost frame, and the tutorial's innermost line."""
    text = Path(path).read_text(errors="replace") if Path(path).exists() else ""
    head, _, dumped = text.partition("\n")
    main = int(head.split("0x")[-1], 16) if head.startswith("main thread 0x") else None
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dumped)
    block = next((b for b in blocks if re.match(rf"(Current thread|Thread) 0x0*{main or 0:x} ", b)), dumped)
    lines = [ln for ln in block.splitlines() if re.match(r"(Current thread|Thread) 0x|  File ", ln)]
    ours = [i for i, ln in enumerate(lines)
            if (m := re.match(r'  File "(.*)", line (\d+)', ln)) and os.path.normpath(m[1]) == src_file]
    line = int(re.search(r"line (\d+)", lines[ours[0]])[1]) if ours else None
    return "\n".join(lines[: ours[-1] + 1] if ours else lines), line


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
    proc = ctx.Process(target=_child, args=(sender, target, args, stack_path), name=f"tutorial {name}")
    ended, timed_out, start = Ended(), False, time.monotonic()
    try:
        proc.start()
        sender.close()
        ready = wait([receiver, proc.sentinel], timeout=limit_s)
        if receiver in ready:
            try:
                kind, value, ended.warnings = receiver.recv()
                ended.value, ended.raised = (value, None) if kind == "returned" else (None, value)
                ended.answered = True
            except EOFError:  # it ended without an answer
                pass
            except Exception as exc:  # noqa: BLE001 - an answer that does not unpickle here
                ended.raised = RuntimeError(f"{name}: the answer of its process could not be read: {exc!r}")
                ended.answered = True
        elif not ready:
            timed_out = True
            if hasattr(signal, "SIGUSR1"):
                os.kill(proc.pid, signal.SIGUSR1)  # faulthandler writes its stack ...
                proc.join(1.0)
            proc.kill()  # ... and it ends
        proc.join()
    finally:
        _kill_group(proc)
        receiver.close()
        ended.seconds = time.monotonic() - start
        ended.stack, line = _stack(stack_path, os.path.normpath(src_file))
        os.unlink(stack_path)
    if not ended.answered:
        at = "" if line is None else f" at line {line}"
        code = proc.exitcode
        if timed_out:
            ended.failure = (f"{name} ran past the per-tutorial limit of {limit_s:g} s{at} (set "
                             f"{TIME_LIMIT_ENV} to change it); its process was killed")
        elif code is not None and code < 0:
            sig = signal.Signals(-code).name
            ended.failure = f"{name}: its process was killed by {sig}{_SIGNAL_HINTS.get(sig, '')}{at}"
        else:
            ended.failure = (f"{name}: its process ended with exit status {code}{at} before its page was "
                             "written (os._exit, or a crash)")
    elif ended.raised is not None and not isinstance(ended.raised, Exception):
        ended.failure = f"{name}: raised {type(ended.raised).__name__}({ended.raised}) outside its code blocks"
        ended.raised = None
    return ended


# --- Sphinx-Gallery's pages ------------------------------------------------------

def _will_run(fname, target_dir, src_dir, gallery_conf) -> bool:
    """Whether Sphinx-Gallery would execute this tutorial (matched by the
    pattern, and changed since it last ran, as its MD5 record says)."""
    from sphinx_gallery import gen_rst
    from sphinx_gallery.utils import get_md5sum

    src_file = os.path.normpath(Path(src_dir, fname))
    if not gen_rst.executable_script(src_file, gallery_conf):
        return False
    md5 = Path(target_dir, Path(fname).name + ".md5")
    current = md5.is_file() and md5.read_text() == get_md5sum(src_file, mode="t")
    return gallery_conf["run_stale_examples"] or not current


def _run_page(fname, target_dir, src_dir, gallery_conf, name, cache):
    """In the tutorial's process: its page, as Sphinx-Gallery generates it."""
    import inspect

    import numpy as np
    import torch
    from sphinx_gallery import gen_rst

    import page_stamp

    if cache is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    tutorial_memory.start_tutorial(name)
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    page_stamp.record_environment(gallery_conf["src_dir"], fname)
    return inspect.unwrap(gen_rst.generate_file_rst)(fname, target_dir, src_dir, gallery_conf)


def _failed_page(fname, target_dir, src_file, gallery_conf, name, ended):
    """Record a tutorial whose process ended without an answer as a failing
    example, with a page that says why."""
    from sphinx_gallery import gen_rst

    target_dir, stem = Path(target_dir), Path(fname).stem
    Path(target_dir, Path(fname).name + ".md5").unlink(missing_ok=True)  # it runs again next time
    parser, _ = gen_rst._get_parser(fname, gallery_conf)
    file_conf, blocks = parser.split_code_and_text_blocks(src_file)[:2]
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
    logger.warning("\n%s unexpectedly failed to execute correctly:\n\n%s", name, indent(report, "    "),
                   type="sphinx_gallery", subtype="example_error")
    out_vars = {"formatted_exception": report, **({"tags": file_conf["tags"]} if "tags" in file_conf else {})}
    return intro, title, (ended.seconds, 0.0), out_vars


def run_each_tutorial_in_its_own_process() -> None:
    """Wrap Sphinx-Gallery's ``generate_file_rst`` (once)."""
    from sphinx_gallery import gen_rst

    original = gen_rst.generate_file_rst
    if getattr(original, "in_own_process", False):
        return

    @functools.wraps(original)
    def generate_file_rst(fname, target_dir, src_dir, gallery_conf):
        if not _will_run(fname, target_dir, src_dir, gallery_conf):
            return original(fname, target_dir, src_dir, gallery_conf)  # runs no code
        src_file = os.path.normpath(Path(src_dir, fname))
        name = Path(os.path.relpath(src_file, gallery_conf["src_dir"])).as_posix()
        cache = _private_cache[0] if _private_cache else None
        ended = run_isolated(_run_page, (fname, target_dir, src_dir, gallery_conf, name, cache),
                             name=name, src_file=src_file, limit_s=time_limit_s())
        if ended.warnings:
            logger.warning("%s: %d warning(s) while its page was generated (above)", name, ended.warnings)
        if ended.raised is not None:
            raise ended.raised
        if ended.failure is not None:
            return _failed_page(fname, target_dir, src_file, gallery_conf, name, ended)
        return ended.value

    generate_file_rst.in_own_process = True
    gen_rst.generate_file_rst = generate_file_rst
