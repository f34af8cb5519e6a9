"""Start-up progress on the console: one line per phase of ``inflight run``, ``pool deploy`` and ``learner attach``
(starting Ray, the rollout pool, the learner, the first prompts) with the seconds since the command started, so that
the minute before the progress bar is not silent.

On a terminal the line of the running phase shows a spinner and its own seconds, and is finished with how long the
phase took (``[  4.2 s] starting the rollout pool (1 engine; vLLM loads the model): 38.1 s``); elsewhere (a pipe, a
log file) the line is printed once as the phase begins, with no control characters. Lines go to stderr, beside
the console's other lines (:mod:`services.console.output`), and only when the console is set up: a library use of these
functions prints nothing.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from services.console import output as console

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
"""Frames of the running phase's spinner (a terminal only)."""
TICK_S = 0.25
"""Seconds between two frames."""
CLEAR = "\r\x1b[K"
"""Back to the start of the line and erase it."""


def since_start() -> float:
    """Seconds since this process started (the command's start, not the import of this module)."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


def _stamp(seconds: float) -> str:
    return f"[{seconds:5.1f} s]"


class _Spinner:
    """Redraws the running phase's line on a terminal until stopped."""

    def __init__(self, stream: TextIO, text: str):
        self.stream, self.text = stream, text
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="startup-spinner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        frame = 0
        while not self._stop.wait(TICK_S):
            frame += 1
            self.stream.write(f"{CLEAR}{self.text} {SPINNER[frame % len(SPINNER)]} "
                              f"{time.monotonic() - self.started:.0f} s")
            self.stream.flush()

    def stop(self, outcome: str) -> None:
        self._stop.set()
        self._thread.join()
        self.stream.write(f"{CLEAR}{self.text}: {outcome}\n")
        self.stream.flush()


@contextmanager
def phase(what: str, stream: TextIO | None = None) -> Iterator[None]:
    """One start-up phase: its line (``[  3.1 s] what``) as it begins; on a terminal a spinner until it ends, then
    its duration (or ``failed after N s``). Nothing without a console (:func:`services.console.output.active`)."""
    if console.active() is None:
        yield
        return
    out = stream or sys.stderr
    text = f"{_stamp(since_start())} {what}"
    if not out.isatty():
        print(text, file=out, flush=True)
        yield
        return
    out.write(text)
    out.flush()
    spinner = _Spinner(out, text)
    try:
        yield
    except BaseException:
        spinner.stop(f"failed after {time.monotonic() - spinner.started:.1f} s")
        raise
    spinner.stop(f"{time.monotonic() - spinner.started:.1f} s")


def note(what: str, stream: TextIO | None = None) -> None:
    """A start-up line without a phase after it (``[ 61.0 s] what``): the last one before the progress bar."""
    if console.active() is not None:
        print(f"{_stamp(since_start())} {what}", file=stream or sys.stderr, flush=True)
