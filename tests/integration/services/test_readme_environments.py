"""README's "Train in a multi-turn environment" block, as a user runs it: the letter relay must learn (its mean
reward over the last 5 steps at least twice that of the first 5, the issue's acceptance; marked ``slow``, about
2.5 minutes: ``make test-all`` runs it) and the calculator
recipe must run end to end (tools in the prompt, episodes of up to 4 turns; the tiny random model rarely
writes a tool call, so it is not asked to)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README_SECTION = "## Train in a multi-turn environment"


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(README_SECTION):], re.S)
    assert block, f"README.md: no bash block under {README_SECTION!r}"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def rows(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "reward_mean" in r and "step" in r]


def run_readme_line(tmp_path: Path, recipe: str) -> Path:
    """Run the README block's line that names ``recipe`` in ``tmp_path``, as a user would; returns the run's
    metrics file."""
    [cmd] = [c for c in readme_commands() if recipe in c]
    for name in (".venv", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PYTEST"))}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{cmd!r} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
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
