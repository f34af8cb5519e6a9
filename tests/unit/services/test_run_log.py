"""metrics.jsonl, the seed's tables and the reward plot."""
from __future__ import annotations

import json

from services.job import StepTimer
from services.run_log import RunLog


def test_rows_tables_and_plot(tmp_path):
    log = RunLog(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        log.write({"step": step, "reward_mean": 0.1 * step, "step_s": 10.0 * step, "policy_training_s": 2.0,
                   "generation_exposed_s": 1.0, "refit_s": 0.5, "other_s": 0.5, "gen_kl_error": 1e-4 * step,
                   "policy_kl_error": 0.0, "probs_ratio_mean": 1.0, "trajectory_age_mean": 1.0})
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    timing = log.timing_table("async")
    assert "| async | 25.00s | 2.00s | 1.00s | 0.50s | 0.50s |" in timing  # step 1 dropped as warm-up
    val = log.validation_table("async")
    assert "| async | 3 | 0.2000 | 2.00e-04 | 3.00e-04 |" in val
    png = log.plot_rewards()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(RunLog(tmp_path, tensorboard=False).rows) == 3  # a resumed run keeps the history


def test_step_timer_splits_phases():
    t = StepTimer()
    with t.phase("policy_training"):
        sum(range(10000))
    s = t.summary()
    assert s["generation_exposed_s"] == 0.0 and s["refit_s"] == 0.0
    assert abs(s["step_s"] - (s["policy_training_s"] + s["other_s"])) < 1e-9
