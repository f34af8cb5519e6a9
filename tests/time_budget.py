"""Per-module time budgets for the test suite: every run given ``--durations-out`` writes each module's seconds
to a JSON file, and with ``--budgets`` a module whose seconds exceed its budget fails the run.

A module's seconds are the sum of setup, call and teardown of its tests (a session fixture's start is charged
to the first test that asks for it). Budgets live in ``tests/budgets.toml``; ``INFLIGHT_TEST_BUDGET_SCALE``
multiplies them all (a loaded or slower machine). The hooks are re-exported by ``tests/conftest.py``.
"""
from __future__ import annotations

import json
import os
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

SCALE_ENV = "INFLIGHT_TEST_BUDGET_SCALE"


@dataclass(frozen=True)
class Overrun:
    """A module that took longer than its budget."""
    module: str
    seconds: float
    budget_s: float


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("inflight budgets")
    group.addoption("--durations-out", default=None, metavar="FILE",
                    help="write each test module's seconds (setup + call + teardown) to FILE as JSON")
    group.addoption("--budgets", default=None, metavar="TOML",
                    help="fail the run when a module's seconds exceed its budget in TOML (tests/budgets.toml)")


MODULE_SECONDS: defaultdict[str, float] = defaultdict(float)
"""This process's seconds per test module (under xdist the controller receives every worker's reports)."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    MODULE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def budget_of(module: str, budgets: dict, scale: float) -> float:
    """The budget of ``module`` (a path such as ``tests/unit/learner/test_loss.py``): its own entry under
    ``[modules]``, else the longest ``[tiers]`` prefix that matches, times ``scale``."""
    own = budgets.get("modules", {}).get(module)
    if own is None:
        tiers = budgets.get("tiers", {})
        matches = [prefix for prefix in tiers if module.startswith(prefix)]
        if not matches:
            raise KeyError(f"{module}: no budget in [modules] and no [tiers] prefix matches it")
        own = tiers[max(matches, key=len)]
    return float(own) * scale


def overruns(seconds: dict[str, float], budgets: dict, scale: float) -> list[Overrun]:
    """The modules of ``seconds`` over their budgets, slowest first."""
    out = [Overrun(module, s, budget_of(module, budgets, scale)) for module, s in seconds.items()]
    return sorted((o for o in out if o.seconds > o.budget_s), key=lambda o: -o.seconds)


def _scale() -> float:
    raw = os.environ.get(SCALE_ENV, "1")
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{SCALE_ENV}={raw!r}: expected a number > 0") from None
    if value <= 0:
        raise pytest.UsageError(f"{SCALE_ENV}={raw!r}: expected a number > 0")
    return value


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: the controller sums every worker's reports
        return
    seconds = dict(sorted(MODULE_SECONDS.items(), key=lambda kv: -kv[1]))
    out = config.getoption("--durations-out")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"total_s": round(sum(seconds.values()), 2),
                                         "modules": {m: round(s, 2) for m, s in seconds.items()}}, indent=1))
    budgets_path = config.getoption("--budgets")
    if not budgets_path:
        return
    budgets = tomllib.loads(Path(budgets_path).read_text())
    over = overruns(seconds, budgets, _scale())
    config._inflight_overruns = over  # type: ignore[attr-defined]
    if over and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    over: list[Overrun] = getattr(config, "_inflight_overruns", [])
    if not over:
        return
    terminalreporter.section("modules over their time budget (tests/budgets.toml)", red=True)
    for o in over:
        terminalreporter.line(f"{o.module}: {o.seconds:.1f} s > budget {o.budget_s:.1f} s")
    terminalreporter.line(f"a slower machine can scale every budget with {SCALE_ENV}")
