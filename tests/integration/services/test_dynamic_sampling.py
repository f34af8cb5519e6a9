"""Dynamic sampling (grpo.use_dynamic_sampling) through the real loop on the session's data pool: zero-advantage
groups are dropped and replaced for their step, the step's numbers reach the row, a trained group without
reward variance only appears once the step's bound on prompts was reached, and the reward function's mean is
that of the trained samples."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from data_pool import data_recipe, write_problems

PER_STEP, MAX_GEN_BATCHES = 4, 2


class RecordingLearner:
    """A learner group that keeps the rewards of each group it is asked to train on."""

    def __init__(self, learner):
        self.learner = learner
        self.trained: list[list[list[float]]] = []  # per step, per group: the valid samples' rewards

    def call(self, method: str, *args):
        if method == "train_step":
            import ray

            from protocol import TrajectoryGroup, decode

            groups = [decode(ray.get(ref), expect=TrajectoryGroup) for ref in args[0]]
            self.trained.append([[float(t.reward) for t in g.valid if t.reward is not None] for g in groups])
        return self.learner.call(method, *args)

    def __getattr__(self, name: str):
        return getattr(self.learner, name)


def test_zero_advantage_groups_are_replaced_until_the_bound(data_pool, tmp_path: Path):
    from services import pool as pool_api
    from services.job.learner_actor import LearnerGroup
    from services.job.learner_job import LearnerJob
    from services.job.loop_async import run_async
    from services.model_source import resolve_model

    data = write_problems(tmp_path / "train.jsonl", 64)
    recipe = data_recipe("grpo.max_num_steps=2", "data.dataset_name=null", f"data.train_data_path={data}",
                         "grpo.use_dynamic_sampling=true",
                         f"grpo.dynamic_sampling_max_gen_batches={MAX_GEN_BATCHES}")
    model_path = resolve_model(recipe.policy.model_name)
    learner = LearnerGroup(recipe, model_path)
    recording = RecordingLearner(learner)
    job = LearnerJob(recipe, model_path, pool_api.connect(data_pool.rollout_pool.name), recording,  # type: ignore[arg-type]
                     tmp_path / "run", resume=False)
    try:
        run_async(job)  # async: replacements are drawn while the next step's prompts are out
        ledger = job.book.ledger
    finally:
        job.close()
        learner.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and len(recording.trained) == 2
    drawn = Counter(ledger.scheduled.values())
    dropped = Counter(ledger.scheduled[p] for p, why in ledger.dropped.items() if why == "zero_advantage")
    for row, groups in zip(rows, recording.trained, strict=True):
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
