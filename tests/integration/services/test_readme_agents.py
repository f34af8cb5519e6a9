"""README's "Train an agent that brings its own loop" block, as a user runs it: the letter relay played by a plain
OpenAI-client agent must learn (its mean reward over the last 5 steps at least twice that of the first 5; marked
``slow``, about 3 minutes: ``make test-all`` runs it) and the calculator agent's recipe must run end to end with no
failed sample (the tiny random model rarely writes a tool call, so it is not asked to)."""
from __future__ import annotations

import pytest
from test_readme_environments import rows, run_readme_line

README_SECTION = "## Train an agent that brings its own loop"


@pytest.mark.slow
def test_readme_agent_relay_learns(tmp_path):
    relay = rows(run_readme_line(tmp_path, "recipes/agent-relay-cpu.yaml", README_SECTION))
    assert [r["step"] for r in relay] == list(range(1, 21))
    first, last = (sum(r["reward_mean"] for r in part) / 5 for part in (relay[:5], relay[-5:]))
    assert last >= 2 * first and last > 0.12, [round(r["reward_mean"], 3) for r in relay]
    assert all(r["env_tokens"] > 0 for r in relay)  # each episode's user turns between its calls
    assert sum(r["failed_samples"] for r in relay) <= 4, [r["failed_samples"] for r in relay]


def test_readme_agent_calculator_runs_end_to_end(tmp_path):
    calc = rows(run_readme_line(tmp_path, "recipes/agent-calculator-cpu.yaml", README_SECTION))
    assert [r["step"] for r in calc] == [1, 2, 3] and all(r["failed_samples"] == 0 for r in calc), calc
