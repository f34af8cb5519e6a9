"""`inflight run` end to end, as `make run` calls it: its own local Ray, pool, learner, teardown."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_inflight_run_two_steps(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_ADDRESS="")
    env.pop("RAY_ADDRESS")
    out = subprocess.run([sys.executable, "-m", "services.cli", "run", "--steps", "2", "--run-dir", str(tmp_path),
                          "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "Step-time breakdown" in out.stdout and "Functional validation" in out.stdout
    assert "/metrics" in out.stderr                          # tells the user where the endpoint is
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    assert (tmp_path / "results" / "checkpoints" / "latest").exists()
