"""Reward scaling and shaping (learner.reward_shaping) by hand, and their place in learner.batch.collect: advantages
from the shaped rewards, the raw ones kept for ``reward_*`` and the shaped ones reported as ``shaped_reward_*``."""
from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from learner.batch import collect
from learner.config import RewardScalingConfig, RewardShapingConfig, TrainStepConfig
from learner.reward_shaping import scale_rewards, shape_rewards, shaped_group_rewards
from protocol.messages import Trajectory, TrajectoryGroup

DAPO_SCALING = RewardScalingConfig(enabled=True, target_min=-1.0)
DAPO_SHAPING = RewardShapingConfig(enabled=True, overlong_buffer_length=2048, overlong_buffer_penalty=1.0,
                                   max_response_length=14336)


def test_scaling_clamps_then_maps_linearly():
    np.testing.assert_allclose(scale_rewards([0.0, 1.0, 0.5, 1.7, -0.3], DAPO_SCALING), [-1.0, 1.0, 0.0, 1.0, -1.0])
    cfg = RewardScalingConfig(enabled=True, source_min=-2.0, source_max=2.0, target_min=0.0, target_max=10.0)
    np.testing.assert_allclose(scale_rewards([-2.0, 0.0, 1.0, 3.0], cfg), [0.0, 5.0, 7.5, 10.0])
    np.testing.assert_allclose(scale_rewards([1.7, -0.3], RewardScalingConfig()), [1.7, -0.3])  # off: unchanged


def test_dapo_overlong_penalty_grows_linearly_over_the_buffer():
    # expected length 14336 - 2048 = 12288; 1024 tokens over it cost 1024/2048 of the penalty
    lengths = [100, 12288, 13312, 14336, 15360]
    shaped = shape_rewards(np.ones(5), lengths, [False] * 5, DAPO_SHAPING)
    np.testing.assert_allclose(shaped, [1.0, 1.0, 0.5, 0.0, -0.5])
    half = DAPO_SHAPING.model_copy(update={"overlong_buffer_penalty": 0.5})
    np.testing.assert_allclose(shape_rewards(np.zeros(2), [13312, 14336], [False, True], half), [-0.25, -0.5])


def test_stop_properly_penalty_replaces_the_overlong_penalty():
    cfg = DAPO_SHAPING.model_copy(update={"stop_properly_penalty_coef": 0.3})
    shaped = shape_rewards(np.array([1.0, 1.0, -1.0]), [15360, 15360, 100], [True, False, True], cfg)
    np.testing.assert_allclose(shaped, [0.3, 1.0, -0.3])  # only truncated answers are scaled; lengths play no part


def test_scaling_comes_before_shaping():
    shaped = shaped_group_rewards([1.0, 0.0], [13312, 100], [False, False], DAPO_SCALING, DAPO_SHAPING)
    np.testing.assert_allclose(shaped, [0.5, -1.0])  # scaled [1, -1], then -0.5 for the long answer
    np.testing.assert_allclose(shaped_group_rewards([1.0, 0.0], [13312, 100], [False, False],
                                                    RewardScalingConfig(), RewardShapingConfig()), [1.0, 0.0])


def _group(rewards: list[float], lengths: list[int]) -> TrajectoryGroup:
    trajs = [Trajectory(np.full(n, 5), np.full(n, -1.0), np.zeros(n), r) for r, n in zip(rewards, lengths, strict=True)]
    return TrajectoryGroup("g0", "p0", np.array([1, 2, 3]), trajs, len(rewards), 64)


def test_collect_computes_advantages_from_the_shaped_rewards_and_keeps_the_raw_ones():
    shaping = RewardShapingConfig(enabled=True, overlong_buffer_length=4, overlong_buffer_penalty=1.0,
                                  max_response_length=12)
    cfg = TrainStepConfig(reward_scaling=DAPO_SCALING, reward_shaping=shaping)
    batch = collect([_group([1.0, 1.0, 0.0, 0.0], [3, 10, 3, 3])], 64, True, cfg)
    # scaled [1, 1, -1, -1]; the 10-token answer is 2 over 12 - 4 = 8: -2/4 -> shaped [1, 0.5, -1, -1]
    assert batch.rewards == [1.0, 1.0, 0.0, 0.0]
    assert batch.shaped_rewards == pytest.approx([1.0, 0.5, -1.0, -1.0])
    shaped = np.array([1.0, 0.5, -1.0, -1.0])
    expected = (shaped - shaped.mean()) / (shaped.std(ddof=1) + 1e-6)  # mean -0.125, sample std sqrt(3.1875 / 3)
    assert expected[0] == pytest.approx(1.125 / (np.sqrt(3.1875 / 3) + 1e-6))
    np.testing.assert_allclose([s.advantage for s in batch.samples], expected, rtol=1e-6)
    m = batch.reward_metrics()
    assert m["shaped_reward_mean"] == pytest.approx(-0.125) and m["shaped_reward_min"] == -1.0
    assert m["shaped_reward_max"] == 1.0 and m["shaped_reward_std"] == pytest.approx(shaped.std())


def test_collect_without_scaling_or_shaping_reports_no_shaped_metrics():
    batch = collect([_group([1.0, 0.0], [3, 10])], 64, False, TrainStepConfig())
    assert batch.reward_metrics() == {} and batch.shaped_rewards == batch.rewards
    assert [s.advantage for s in batch.samples] == pytest.approx([0.5, -0.5])


def test_shaping_can_give_signal_to_a_group_of_equal_raw_rewards():
    shaping = RewardShapingConfig(enabled=True, overlong_buffer_length=4, overlong_buffer_penalty=1.0,
                                  max_response_length=12)
    batch = collect([_group([1.0, 1.0], [3, 10])], 64, False, TrainStepConfig(reward_shaping=shaping))
    assert batch.zero_advantage_groups == 0
    assert [s.advantage for s in batch.samples] == pytest.approx([0.25, -0.25])  # shaped [1, 0.5]


@pytest.mark.parametrize(("model", "kw", "match"), [
    (RewardScalingConfig, {"source_min": 1.0, "source_max": 1.0}, r"source_max \(1.0\) must be > source_min \(1.0\)"),
    (RewardScalingConfig, {"target_min": 1.0, "target_max": -1.0}, r"target_max \(-1.0\) must be > target_min"),
    (RewardShapingConfig, {"enabled": True, "overlong_buffer_length": 128},
     r"needs overlong_buffer_penalty, max_response_length"),
    (RewardShapingConfig, {"enabled": True, "overlong_buffer_length": 600, "overlong_buffer_penalty": 1.0,
                           "max_response_length": 512},
     r"overlong_buffer_length \(600\) must be <= max_response_length \(512\)"),
    (RewardShapingConfig, {"stop_properly_penalty_coef": 1.5}, r"(?s)stop_properly_penalty_coef.*less than or equal"),
])
def test_bad_reward_options_are_refused(model, kw, match):
    with pytest.raises(ValidationError, match=match):
        model(**kw)


def test_stop_properly_penalty_needs_no_overlong_settings():
    RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.0)
