"""Validation through the real async loop on the session's data pool: val_* metrics at step 0 (val_at_start) and
every val_period steps, answered at the job's current version, never trained on (the ledger and the learner's
batches hold no val: prompt), training ages within the lag with nothing dropped as stale, and the checkpoints
ranked by the validation metric."""
from __future__ import annotations

import json
from pathlib import Path

from data_pool import data_recipe, run_recorded_async, write_problems

VAL_KEYS = {"val_reward_mean", "val_accuracy", "val_samples", "val_failed_samples", "val_seconds", "val_policy_version"}


def test_validation_runs_at_start_and_every_period_outside_the_training_stream(data_pool, fresh_learner,
                                                                              tmp_path: Path):
    from services.job.checkpoints import METRIC_FILE

    train = write_problems(tmp_path / "train.jsonl", 32)
    val = write_problems(tmp_path / "val.jsonl", 8, start=1000)
    recipe = data_recipe("grpo.max_num_steps=2", "grpo.async_grpo.enabled=true", "data.dataset_name=null",
                         f"data.train_data_path={train}",
                         f"data.val_data_path={val}",
                         "grpo.val_at_start=true", "grpo.val_period=2", "grpo.max_val_samples=3",
                         "grpo.val_batch_size=2",  # greedy, one answer a prompt (the defaults): no pass@k
                         "checkpointing.metric_name=val_accuracy", "checkpointing.keep_top_k=1")
    job, recording = run_recorded_async(fresh_learner, recipe, tmp_path / "run")
    ledger, ckpt_root = job.book.ledger, job.checkpoints.root
    trained = [[g.prompt_id for g in b] for b in recording.batches]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [VAL_KEYS <= set(r) for r in rows] == [True, False, True]     # at start and at step 2 only
    for r in (rows[0], rows[2]):
        assert r["val_samples"] == 3 and 0 <= r["val_failed_samples"] < r["val_samples"] and "val_pass_at_k" not in r
        assert r["val_policy_version"] == r["policy_version"]            # validated at the job's version
        assert 0.0 <= r["val_accuracy"] <= 1.0 and 0.0 <= r["val_reward_mean"] <= 1.0
    assert rows[0]["policy_version"] == 0 and rows[2]["policy_version"] == 2
    every_id = [*ledger.scheduled, *ledger.trained, *ledger.dropped, *(p for b in trained for p in b)]
    assert every_id and not [p for p in every_id if p.startswith("val:")]  # never trained on, never in the ledger
    assert len(trained) == 2 and all(len(b) == recipe.grpo.num_prompts_per_step for b in trained)
    assert "stale" not in ledger.dropped.values()                         # validation aged no training group
    assert [r["trajectory_age_max"] <= 1 for r in rows[1:]] == [True, True]
    kept = sorted(p.name for p in ckpt_root.glob("step_*"))               # the best by val_accuracy + the newest
    assert kept == ["step_000002"]  # step 1 had no val_accuracy: it ranked last and went
    stored = json.loads((ckpt_root / "step_000002" / METRIC_FILE).read_text())
    assert stored == {"step": 2, "metric_name": "val_accuracy", "value": rows[2]["val_accuracy"]}
