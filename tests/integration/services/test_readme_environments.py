"""README's "Train in a multi-turn environment" block, as a user runs it: the letter relay must learn (its mean
reward over the last 5 steps at least twice that of the first 5, the issue's acceptance; marked ``slow``, about
2.5 minutes: ``make test-all`` runs it) and the calculator
recipe must run end to end (tools in the prompt, episodes of up to 4 turns; the tiny random model rarely
writes a tool call, so it is not asked to)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from readme_blocks import readme_commands, run_as_user

README_SECTION = "## Train in a multi-turn environment"


def rows(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "reward_mean" in r and "step" in r]


def run_readme_line(tmp_path: Path, recipe: str, section: str = README_SECTION) -> Path:
    """Run the line of README ``section``'s block that names ``recipe`` in ``tmp_path``, as a user would; returns
    the run's metrics file."""
    [cmd] = [c for c in readme_commands(section) if recipe in c]
    run_as_user(tmp_path, [cmd], links=(".venv", "recipes"), pythonpath=True)
    return tmp_path / "runs" / Path(recipe).stem / "metrics.jsonl"


@pytest.mark.slow
def test_readme_letter_relay_learns(tmp_path):
    relay = rows(run_readme_line(tmp_path, "recipes/letter-relay-cpu.yaml"))
    assert [r["step"] for r in relay] == list(range(1, 21))
    first, last = (sum(r["reward_mean"] for r in part) / 5 for part in (relay[:5], relay[-5:]))
    assert last >= 2 * first and last > 0.15, [round(r["reward_mean"], 3) for r in relay]
    assert all(r["env_tokens"] > 0 and r["failed_samples"] == 0 for r in relay)


def test_readme_calculator_runs_end_to_end(tmp_path):
    calc = rows(run_readme_line(tmp_path, "recipes/calculator-cpu.yaml"))
    assert [r["step"] for r in calc] == [1, 2, 3] and all(r["failed_samples"] == 0 for r in calc), calc
