"""Validation (services/job/validation.py): the metrics from fake groups (accuracy of the first answer, pass@k,
failed and missing answers), the step row's keys, val: ids, the batches sent to the pool's evaluate call, and a
job that validates at start and every val_period steps without touching its ledger."""
from __future__ import annotations

import math

import numpy as np
import pytest
from handle_fakes import ServeMethod
from job_fakes import FakePool, ListChannel, group, make_job

from protocol import PromptRequest, Trajectory, TrajectoryGroup, decode, encode
from protocol.pool_replies import EvaluationReply, FailedPrompt
from services.recipe.config import load_recipe
from services.job import validation
from services.job.validation import Validator, validation_metrics


def test_accuracy_counts_first_answers_and_pass_at_k_any_answer():
    rewards = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.999_999_5, None, 0.0]]
    r = validation_metrics(rewards, k=3, seconds=2.0)
    assert r.accuracy == pytest.approx(2 / 4)           # prompts 0 and 3 (within 1e-6 of 1.0)
    assert r.pass_at_k == pytest.approx(3 / 4)          # prompts 0, 1, 3
    assert r.reward_mean == pytest.approx((1 + 1 + 0.999_999_5) / 11)
    assert (r.samples, r.failed_samples) == (12, 1)
    m = r.metrics()
    assert set(m) == {"val_reward_mean", "val_accuracy", "val_pass_at_k", "val_samples", "val_failed_samples",
                      "val_seconds"} and m["val_seconds"] == 2.0


def test_failed_first_answers_are_not_counted_wrong_and_k1_has_no_pass_at_k():
    r = validation_metrics([[None], [1.0], [0.5], [None]], k=1, policy_version=3)
    assert r.accuracy == pytest.approx(1 / 2) and r.pass_at_k is None
    assert r.failed_samples == 2 and r.reward_mean == pytest.approx(0.75)
    assert "val_pass_at_k" not in r.metrics() and r.metrics()["val_policy_version"] == 3
    nothing = validation_metrics([[None, None]], k=2)
    assert math.isnan(nothing.accuracy) and math.isnan(nothing.reward_mean) and math.isnan(nothing.pass_at_k or 0)


def scored(pid: str, rewards: list[float | None], version: int = 2) -> TrajectoryGroup:
    trajs = [Trajectory([1, 2], [-0.5, -0.25], [version, version], r, "stop" if r is not None else "error",
                        "" if r is not None else "boom") for r in rewards]
    return TrajectoryGroup(f"g-{pid}", pid, [5], trajs, len(rewards), 16)


class EvalPool(FakePool):
    """A pool whose evaluate answers reward 1.0 to ids ending in an even digit, 0.0 otherwise; one prompt of
    each batch (``drop``) never comes back."""

    def __init__(self, channel=None, answer=None, drop: str | None = None):
        super().__init__(channel, answer)
        self.batches: list[tuple[list[str], int, float]] = []
        self.drop = drop
        self.evaluate = ServeMethod(self._evaluate)

    def _evaluate(self, prompt_bytes, k, temperature, timeout_s):
        ids = [decode(b, expect=PromptRequest).prompt_id for b in prompt_bytes]
        self.batches.append((ids, k, temperature))
        groups = [encode(scored(p, [float(int(p[-1]) % 2 == 0)] * k)) for p in ids if p != self.drop]
        return EvaluationReply(groups, [FailedPrompt(self.drop, "x")] if self.drop in ids else [])


def val_prompts(n: int) -> list[PromptRequest]:
    return [PromptRequest(f"val:q{i}", np.array([1, 2]), {}) for i in range(n)]


def test_the_validator_sends_batches_and_counts_a_missing_group_as_failed():
    recipe = load_recipe(None, ["grpo.val_batch_size=2", "grpo.val_num_generations=2", "grpo.val_temperature=0.7",
                                "grpo.val_period=2"])
    pool = EvalPool(drop="val:q3")
    v = Validator(recipe, val_prompts(5), pool)
    assert [s for s in range(1, 7) if v.due(s)] == [2, 4, 6]
    r = v.run(2)
    assert [b[0] for b in pool.batches] == [["val:q0", "val:q1"], ["val:q2", "val:q3"], ["val:q4"]]
    assert {(k, t) for _, k, t in pool.batches} == {(2, 0.7)}
    assert r.samples == 10 and r.failed_samples == 2 and r.policy_version == 2
    assert r.accuracy == pytest.approx(3 / 4) and r.pass_at_k == pytest.approx(3 / 4)  # q0, q2, q4 of 4 answered


def test_a_job_validates_at_start_and_every_period_outside_its_ledger(monkeypatch, tmp_path):
    from services.job.run_log import StepTimer

    monkeypatch.setattr("services.job.learner_job.validation_prompts", lambda r, m: val_prompts(3))
    pool = EvalPool(ListChannel(), answer=lambda req: group(req.prompt_id, req.scheduled_step))
    job = make_job(monkeypatch, tmp_path, pool=pool,
                   overrides=("grpo.val_at_start=true", "grpo.val_period=2", "grpo.max_num_steps=3",
                              "checkpointing.enabled=false"))
    job.start(prefetch=0)
    for step in (1, 2, 3):
        job.schedule(step)
        job.finish_step(step, {"reward_mean": 0.5}, StepTimer())
    rows = job.log.rows
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [("val_accuracy" in r) for r in rows] == [True, False, True, False]
    assert rows[0]["val_accuracy"] == pytest.approx(2 / 3) and "reward_mean" not in rows[0]
    assert rows[2]["val_samples"] == 3 and "validation_s" not in rows[2]
    assert [r.get("val_accuracy") for r in pool.reports][:1] == [pytest.approx(2 / 3)]
    assert not [p for p in job.book.ledger.scheduled if p.startswith("val:")]
    assert len(pool.batches) == 2
    job.close()


def test_the_pools_metrics_show_the_validation_numbers():
    from services.pool.metrics import PoolMetrics

    m = PoolMetrics()
    m.record_step({"step": 0, "val_reward_mean": 0.25, "val_accuracy": 0.5, "val_pass_at_k": 0.75})
    text = m.render().decode()
    for line in ("inflight_val_reward_mean 0.25", "inflight_val_accuracy 0.5", "inflight_val_pass_at_k 0.75"):
        assert line in text


def test_the_step_0_validation_row_is_on_the_curve_but_not_in_the_training_summaries(tmp_path, monkeypatch):
    from services.job.run_log import RunLog

    log = RunLog(tmp_path, tensorboard=False)
    log.write({"step": 0, "policy_version": 0, "val_reward_mean": 0.1, "val_accuracy": 0.0})
    for step in (1, 2, 3):
        log.write({"step": step, "reward_mean": 0.1 * step, "step_s": 10.0 * step, "trajectory_age_mean": 1.0,
                   **({"val_reward_mean": 0.5, "val_accuracy": 0.5} if step == 2 else {})})
    assert [r["step"] for r in log.warm_rows()] == [2, 3]                   # step 1 is still the warm-up
    assert "| async | 3 | 0.2000 |" in log.validation_table("async")       # 3 training steps, their mean
    drawn: list[tuple[list, list, str]] = []
    import matplotlib.axes

    real_plot = matplotlib.axes.Axes.plot

    def spy(self, x, y, *args, **kw):
        drawn.append((list(x), list(y), kw.get("label", "")))
        return real_plot(self, x, y, *args, **kw)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    assert log.plot_rewards().read_bytes()[:4] == b"\x89PNG"
    assert drawn[0][:2] == ([1, 2, 3], [0.1, 0.2, pytest.approx(0.3)])
    assert drawn[1] == ([0, 2], [0.1, 0.5], "validation reward")
    assert drawn[2] == ([0, 2], [0.0, 0.5], "validation accuracy")
