"""Statistics of a step's trained groups (services/job/batch_stats.py): per-reward-function means, and the
zero-advantage test of dynamic sampling."""
from __future__ import annotations

import numpy as np
from job_fakes import FakeLearner, FakePool, ListChannel, make_job

from protocol import Trajectory, TrajectoryGroup
from services.job.batch_stats import batch_stats, zero_advantage


def sample(reward: float | None, components: dict[str, float] | None = None) -> Trajectory:
    ok = reward is not None
    return Trajectory(np.array([1, 2]), np.array([-0.5, -0.25]), np.array([0, 0]), reward, "stop" if ok else "error",
                      "" if ok else "boom", components or {})


def group(*samples: Trajectory) -> TrajectoryGroup:
    return TrajectoryGroup("g", "p", np.array([5]), list(samples), len(samples), 16)


def test_zero_advantage_needs_two_valid_samples_with_equal_rewards():
    assert zero_advantage(group(sample(1.0), sample(1.0), sample(None)))
    assert zero_advantage(group(sample(0.3), sample(0.1 + 0.2)))       # equal up to float rounding
    assert not zero_advantage(group(sample(1.0), sample(0.0)))
    assert not zero_advantage(group(sample(1.0), sample(None)))        # one valid sample: too few, not this


def test_per_function_means_over_valid_samples():
    stats = batch_stats([
        group(sample(1.0, {"format": 1.0, "exact_answer": 1.0}), sample(0.2, {"format": 1.0, "exact_answer": 0.0})),
        group(sample(0.0, {"format": 0.0, "exact_answer": 0.0}), sample(0.0, {"format": 0.0, "exact_answer": 0.0}),
              sample(None, {"format": 5.0})),                          # failed: not in the means
    ])
    assert stats.metrics() == {"reward_exact_answer_mean": 0.25, "reward_format_mean": 0.5}


def test_without_reward_components_there_are_no_function_means():
    assert batch_stats([group(sample(1.0), sample(0.0))]).metrics() == {}


class TrainingLearner(FakeLearner):
    """A learner fake that also trains (one version up, no metrics of its own)."""

    def train_step(self, group_refs: list, images: dict | None = None) -> dict:
        self.at_version += 1
        return {"loss": 0.0}


def test_the_jobs_train_metrics_carry_the_function_means_and_dynamic_samplings_numbers(monkeypatch, tmp_path):
    import ray

    def answer(req):                                                  # the first prompt's group has no signal
        rewards = (1.0, 1.0) if not answered else (1.0, 0.0)
        answered.append(req.prompt_id)
        out = group(*(sample(r, {"format": r}) for r in rewards))
        out.prompt_id, out.scheduled_step = req.prompt_id, req.scheduled_step
        return out

    answered: list[str] = []
    monkeypatch.setattr(ray, "put", lambda data: data)
    job = make_job(monkeypatch, tmp_path, pool=FakePool(ListChannel(), answer), learner=TrainingLearner(),
                   overrides=("grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=3"))
    job.schedule(1)
    metrics = job.train(job.collect(1))
    assert len(answered) == 2 and job.book.ledger.dropped == {answered[0]: "zero_advantage"}
    assert metrics["dynamic_sampling_dropped"] == 1
    assert metrics["dynamic_sampling_attempts"] == 2.0 and metrics["dynamic_sampling_exhausted"] == 0
    assert metrics["reward_format_mean"] == 0.5                      # over the wire, from the trained group


def test_zero_advantage_is_judged_after_reward_scaling():
    from learner.config import RewardScalingConfig

    clamps = RewardScalingConfig(enabled=True, target_min=-1.0)      # source range [0, 1]: 1.0 and 1.5 both map to 1
    assert not zero_advantage(group(sample(1.0), sample(1.5)))
    assert zero_advantage(group(sample(1.0), sample(1.5)), clamps)
    assert not zero_advantage(group(sample(0.0), sample(1.0)), clamps)
