"""Issue 33.8: start-up phases on the console, one line each with the seconds since the command started; on a
terminal a spinner while the phase runs and its duration at the end; nothing without a console (library use)."""
from __future__ import annotations

import io
import re
import time

import pytest

from services.console import output as console


from services.console import progress as startup_progress
STAMP = r"\[\s*\d+\.\d s\]"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def screen(tmp_path, monkeypatch):
    monkeypatch.setattr(console, "_active", console.Console(tmp_path / "logs", verbose=False))


def test_a_pipe_gets_one_plain_line_as_each_phase_begins(screen):
    out = io.StringIO()
    with startup_progress.phase("starting Ray", out):
        assert re.fullmatch(rf"{STAMP} starting Ray\n", out.getvalue())  # said before the phase's work
    startup_progress.note("training: the first prompts go to the pool", out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and re.fullmatch(rf"{STAMP} training: the first prompts go to the pool", lines[1])
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    first, second = (float(re.search(r"[\d.]+", ln).group()) for ln in lines)
    assert 0 <= first <= second


def test_a_terminal_gets_a_spinner_then_the_duration(screen, monkeypatch):
    monkeypatch.setattr(startup_progress, "TICK_S", 0.01)
    out = Terminal()
    with startup_progress.phase("starting the rollout pool", out):
        time.sleep(0.2)
    text = out.getvalue()
    assert any(frame in text for frame in startup_progress.SPINNER) and startup_progress.CLEAR in text
    last = text.split(startup_progress.CLEAR)[-1]
    assert re.fullmatch(rf"{STAMP} starting the rollout pool: 0\.\d s\n", last), repr(last)


def test_a_failed_phase_says_so_and_the_error_goes_on(screen):
    out = Terminal()
    with pytest.raises(RuntimeError), startup_progress.phase("starting the learner", out):
        raise RuntimeError("boom")
    assert re.search(rf"{STAMP} starting the learner: failed after \d+\.\d s\n$", out.getvalue())


def test_nothing_is_printed_without_a_console(monkeypatch):
    monkeypatch.setattr(console, "_active", None)
    out = Terminal()
    with startup_progress.phase("starting Ray", out):
        pass
    startup_progress.note("training", out)
    assert out.getvalue() == ""
