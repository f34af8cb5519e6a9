"""Batch collection and the optimizer-step split (learner.batch) without a model."""
from __future__ import annotations

import numpy as np
import pytest

from learner.batch import collect, split
from learner.config import TrainStepConfig
from protocol.messages import Trajectory, TrajectoryGroup


def _group(gid: int, rewards: list[float | None], reasons: list[str] | None = None) -> TrajectoryGroup:
    reasons = reasons or ["stop"] * len(rewards)
    trajs = []
    for i, (r, why) in enumerate(zip(rewards, reasons, strict=True)):
        n = 3 + i
        reason = "error" if r is None else why
        trajs.append(Trajectory(np.full(n, 5 + i), np.full(n, -1.0), np.zeros(n), r, reason,
                                "failed" if r is None else ""))
    return TrajectoryGroup(f"g{gid}", f"p{gid}", np.array([1, 2, 3]), trajs, len(rewards), 64)


def test_split_counts_failed_trajectories_so_steps_follow_positions():
    groups = [_group(0, [1.0, None, 0.0, 1.0]), _group(1, [0.0, 1.0, None, None])]
    batch = collect(groups, 64, True, TrainStepConfig())
    assert batch.num_trajectories == 8 and batch.failed_samples == 3
    steps = split(batch, 2)
    assert [[s.position for s in step] for step in steps] == [[0], [2, 3], [4, 5], []]
    assert split(batch, 8) == [batch.samples] and split(batch, None) == [batch.samples]
    with pytest.raises(ValueError, match=r"train_global_batch_size \(3\).*8 trajectories"):
        split(batch, 3)


def test_overlong_filtering_keeps_the_reward_in_the_baseline_and_counts_the_sample():
    g = _group(0, [1.0, 0.0, 0.0, 1.0], ["length", "stop", "length", "stop"])
    plain = collect([g], 64, False, TrainStepConfig())
    filtered = collect([g], 64, False, TrainStepConfig(overlong_filtering=True))
    assert plain.length_finished == filtered.length_finished == 2 and plain.overlong_filtered == 0
    assert filtered.overlong_filtered == 2 and [s.position for s in filtered.samples] == [1, 3]
    assert [s.advantage for s in filtered.samples] == pytest.approx([-0.5, 0.5])  # baseline of all 4 rewards
    assert filtered.rewards == plain.rewards == [1.0, 0.0, 0.0, 1.0]
    assert filtered.response_lengths == [3, 4, 5, 6]


def test_leave_one_out_reaches_the_samples():
    batch = collect([_group(0, [2.0, 0.0, 1.0])], 64, False, TrainStepConfig(use_leave_one_out_baseline=True))
    assert [s.advantage for s in batch.samples] == pytest.approx([2 - 0.5, 0 - 1.5, 1 - 1.0])
