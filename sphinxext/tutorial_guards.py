"""Guards around every code block a tutorial runs.

Sphinx-Gallery executes a tutorial block by block, each through the
``show_memory`` callable (``tutorial_memory.PeakMemory``), which runs the
block through :func:`run_block`. That gives two guarantees:

* **A time limit per tutorial** (``TUTORIAL_TIME_LIMIT_S``, default 900 s).
  Past it, :class:`TutorialTimeout` is raised inside the tutorial's code. It
  derives from ``BaseException``, like ``KeyboardInterrupt``, so a tutorial's
  ``except Exception`` does not swallow it. The timer runs only while the
  tutorial's own code runs: never during Sphinx-Gallery's figure scraping
  and writing. With ``SIGALRM`` (POSIX, main thread) it interrupts even a
  blocking call; elsewhere a watchdog thread raises it in the running thread
  at its next Python instruction.
* **No ``sys.exit``**: a ``SystemExit`` raised by a tutorial would end the
  build and leave a half-written site.

In both cases the block ends with :class:`TutorialFailure`, an ordinary
exception naming the tutorial and the line it was stopped at, so
Sphinx-Gallery records the page as failed and the build fails once every
page has run.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import PurePath

TIME_LIMIT_ENV = "TUTORIAL_TIME_LIMIT_S"
DEFAULT_TIME_LIMIT_S = 900


class TutorialTimeout(BaseException):
    """Raised inside a tutorial that ran past its time limit."""


class TutorialFailure(RuntimeError):
    """Raised to Sphinx-Gallery once the tutorial's code has unwound."""


_current = {"file": None, "deadline": None}


def time_limit_s() -> float:
    raw = os.environ.get(TIME_LIMIT_ENV, str(DEFAULT_TIME_LIMIT_S))
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{TIME_LIMIT_ENV} must be a number of seconds, got {raw!r}") from None


def start_tutorial(name: str) -> None:
    """Called before a tutorial runs (``tutorial_isolation.reset_state``)."""
    _current["file"] = name
    _current["deadline"] = time.monotonic() + time_limit_s()


def end_tutorial() -> None:
    _current["file"] = _current["deadline"] = None


def _timeout_message(where: str = "") -> str:
    return (f"{_current['file']} ran past the per-tutorial limit of {time_limit_s():g} s{where} "
            f"(set {TIME_LIMIT_ENV} to change it)")


def _where(exc: BaseException) -> str:
    """" at line N": the tutorial's innermost line in ``exc``'s traceback."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if PurePath(tb.tb_frame.f_code.co_filename).as_posix().endswith("/" + _current["file"]):
            line = tb.tb_lineno
        tb = tb.tb_next
    return "" if line is None else f" at line {line}"


def _use_sigalrm() -> bool:
    return hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()


class _Timer:
    """Raises TutorialTimeout in the calling thread after ``seconds``, until
    cancelled."""

    def __init__(self, seconds: float):
        self.active = True
        self.lock = threading.Lock()
        self.thread_id = threading.get_ident()
        if _use_sigalrm():
            self.previous = signal.signal(signal.SIGALRM, self._on_signal)
            signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
            self.watchdog = None
        else:
            self.previous = None
            self.watchdog = threading.Timer(seconds, self._on_watchdog)
            self.watchdog.daemon = True
            self.watchdog.start()

    def _on_signal(self, signum, frame):  # noqa: ARG002 - signal handler signature
        if self.active:
            raise TutorialTimeout

    def _on_watchdog(self):
        # Repeat until the tutorial's thread notices (an asynchronous exception
        # is raised at the thread's next Python instruction) and cancels; under
        # the lock, so none is set once cancel() has run.
        while True:
            with self.lock:
                if not self.active:
                    return
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.thread_id), ctypes.py_object(TutorialTimeout))
            time.sleep(0.05)

    def cancel(self):
        with self.lock:
            self.active = False
            if self.watchdog is None:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, self.previous)
            else:
                self.watchdog.cancel()
                # Take back an exception set but not raised yet.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)

    def disarm(self):
        """cancel(), even when the limit strikes during it (the timeout it
        raises there is dropped: the block has already ended)."""
        while True:
            try:
                self.cancel()
                return
            except TutorialTimeout:
                continue


def run_block(func):
    """Run one code block of the current tutorial under the guards."""
    name = _current["file"]
    if name is None:  # not inside a tutorial (a memory baseline, a test)
        return func()
    remaining = _current["deadline"] - time.monotonic()
    if remaining <= 0:
        raise TutorialFailure(_timeout_message())
    timer = _Timer(remaining)
    try:
        try:
            return func()
        finally:
            timer.disarm()
    except TutorialTimeout as exc:
        raise TutorialFailure(_timeout_message(_where(exc))) from None
    except SystemExit as exc:
        raise TutorialFailure(
            f"{name} called sys.exit({exc.code!r}) (or raised SystemExit){_where(exc)}: a tutorial "
            "must not end the build; raise an exception instead") from None
