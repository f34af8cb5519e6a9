"""Failed samples reach the run directory (issue 33, item 5), as a user sees it: `inflight run` of the letter
relay with an environment whose first four resets raise ``KeyError: 'secret'``. Those samples fail (never scored
0): their reasons are in RUN_DIR/failures.jsonl (kind ``environment``, the environment's reason, the source
``relay``) and the step row counts them in ``failed_samples`` and ``failed_samples_environment``, also those of
groups dropped for too few valid samples (before, the row said 0 and no file held the reason)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FAILING_RESETS = 4
ENV_FILE = f'''
import threading
from rollout.episodes.envs.letter_relay import LetterRelay

class Picky(LetterRelay):
    """The letter relay, whose first {FAILING_RESETS} resets (of this engine's instance) raise KeyError."""

    def __init__(self):
        super().__init__()
        self.resets, self.lock = 0, threading.Lock()

    def reset(self, task):
        with self.lock:
            self.resets += 1
            n = self.resets
        if n <= {FAILING_RESETS}:
            raise KeyError("secret")
        return super().reset(task)
'''


def inflight_run(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_ROTATION_"))}
    return subprocess.run([sys.executable, "-m", "services.cli", "run", "--run-dir", str(run_dir), *args],
                          env={**env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=900)


def test_environment_failures_are_in_failures_jsonl_and_counted_in_the_step_row(tmp_path):
    env = tmp_path / "picky_env.py"
    env.write_text(ENV_FILE)
    run = tmp_path / "run"
    out = inflight_run(run, "--recipe", "recipes/letter-relay-cpu.yaml", "--steps", "1",
                       "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
                       f"env.relay.environment={env}:Picky")
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [json.loads(x) for x in (run / "failures.jsonl").read_text().splitlines()]
    assert lines and sum(x["samples"] for x in lines) == FAILING_RESETS, lines
    assert all(x["kind"] == "environment" and x["source"] == "relay" and x["step"] == 1 for x in lines), lines
    assert all(x["reason"].startswith("environment '") and x["reason"].endswith(": reset raised KeyError: 'secret'")
               for x in lines), lines
    (row,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["failed_samples"] == row["failed_samples_environment"] == FAILING_RESETS, row
    assert row["failed_samples_generation"] == row["failed_samples_reward"] == row["failed_samples_length"] == 0
