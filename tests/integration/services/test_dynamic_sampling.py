"""Dynamic sampling (grpo.use_dynamic_sampling) through the real loop on the session's data pool: zero-advantage
groups are dropped and replaced for their step, the step's numbers reach the row, a trained group without
reward variance only appears once the step's bound on prompts was reached, and the reward function's mean is
that of the trained samples."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from data_pool import data_recipe, run_recorded_async, write_problems

PER_STEP, MAX_GEN_BATCHES = 4, 2


def test_zero_advantage_groups_are_replaced_until_the_bound(data_pool, fresh_learner, tmp_path: Path):
    data = write_problems(tmp_path / "train.jsonl", 64)
    recipe = data_recipe("grpo.max_num_steps=2", "data.dataset_name=null", f"data.train_data_path={data}",
                         "grpo.use_dynamic_sampling=true",
                         f"grpo.dynamic_sampling_max_gen_batches={MAX_GEN_BATCHES}")
    # async: replacements drawn while the next step's prompts are out
    job, recording = run_recorded_async(fresh_learner, recipe, tmp_path / "run")
    ledger = job.book.ledger
    trained = [[[float(t.reward) for t in g.valid if t.reward is not None] for g in b] for b in recording.batches]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and len(trained) == 2
    drawn = Counter(ledger.scheduled.values())
    dropped = Counter(ledger.scheduled[p] for p, why in ledger.dropped.items() if why == "zero_advantage")
    for row, groups in zip(rows, trained, strict=True):
        step = row["step"]
        assert len(groups) == PER_STEP                                   # the step always gets its groups
        flat = sum(max(g) - min(g) <= 1e-9 for g in groups)
        assert row["dynamic_sampling_exhausted"] == row["zero_advantage_groups"] == flat  # the learner's count
        assert row["dynamic_sampling_dropped"] == dropped[step]
        assert row["dynamic_sampling_attempts"] == drawn[step] / PER_STEP
        if flat:                                                          # kept only past the bound
            assert drawn[step] >= MAX_GEN_BATCHES * PER_STEP
        assert dropped[step] <= MAX_GEN_BATCHES * PER_STEP - PER_STEP    # no zero-advantage drop past it
        rewards = [r for g in groups for r in g]                          # one function of weight 1: its mean
        assert row["reward_math_verify_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert rows[-1].get("dropped_zero_advantage", 0) == sum(dropped.values())
    assert sum(dropped.values()) + sum(r["zero_advantage_groups"] for r in rows) > 0  # the case was exercised
