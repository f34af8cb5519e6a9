"""tests/time_budget.py: a module's budget, the overruns, and a run that goes over failing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from time_budget import Overrun, budget_of, overruns

TESTS = Path(__file__).resolve().parents[2]
BUDGETS = {"tiers": {"tests/unit/": 20, "tests/unit/slow/": 60, "tests/integration/": 120},
           "modules": {"tests/integration/test_big.py": 400}}


def test_a_module_takes_its_own_budget_else_the_longest_tier_prefix():
    assert budget_of("tests/integration/test_big.py", BUDGETS, 1.0) == 400
    assert budget_of("tests/unit/slow/test_x.py", BUDGETS, 1.0) == 60
    assert budget_of("tests/unit/test_y.py", BUDGETS, 2.0) == 40


def test_a_module_with_no_budget_is_named():
    with pytest.raises(KeyError, match="tests/other/test_z.py"):
        budget_of("tests/other/test_z.py", BUDGETS, 1.0)


def test_overruns_are_the_modules_over_budget_slowest_first():
    seconds = {"tests/unit/test_a.py": 25.0, "tests/unit/test_b.py": 19.0, "tests/unit/test_c.py": 50.0,
               "tests/integration/test_big.py": 399.0}
    assert overruns(seconds, BUDGETS, 1.0) == [Overrun("tests/unit/test_c.py", 50.0, 20.0),
                                              Overrun("tests/unit/test_a.py", 25.0, 20.0)]
    assert overruns(seconds, BUDGETS, 3.0) == []


def _run(tmp_path: Path, budget_s: float) -> tuple[int, str, dict]:
    (tmp_path / "conftest.py").write_text(
        f"import sys; sys.path.insert(0, {str(TESTS)!r})\n"
        "from time_budget import pytest_addoption, pytest_runtest_logreport, pytest_sessionfinish, "
        "pytest_terminal_summary  # noqa: F401\n")
    (tmp_path / "test_sleepy.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(0.3)\n")
    (tmp_path / "budgets.toml").write_text(f'[tiers]\n"test_" = {budget_s}\n')
    out = tmp_path / "durations.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "--durations-out", str(out), "--budgets", str(tmp_path / "budgets.toml"),
                           str(tmp_path / "test_sleepy.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, json.loads(out.read_text())


def test_a_run_over_budget_fails_and_one_within_passes(tmp_path):
    rc, stdout, durations = _run(tmp_path, 0.1)
    assert rc == 1, stdout
    assert "test_sleepy.py" in stdout and "over their time budget" in stdout
    assert durations["modules"]["test_sleepy.py"] >= 0.3
    rc, stdout, _ = _run(tmp_path, 60)
    assert rc == 0, stdout
