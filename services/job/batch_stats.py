"""Statistics of the groups a learner step trains on, beside the learner's own metrics.

The learner reports the batch's rewards, response lengths, truncation, entropy and its ``zero_advantage_groups``
/ ``failed_samples`` counts; this module adds what only the job sees: the mean of each reward function
(``reward_<name>_mean``, from ``Trajectory.reward_components``). :func:`zero_advantage` is dynamic sampling's
test (:mod:`services.job.prompt_book`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from learner.config import RewardScalingConfig
from learner.reward_shaping import scale_rewards
from protocol import TrajectoryGroup

ZERO_ADVANTAGE_TOL = 1e-9
"""Rewards closer than this are equal (weighted sums of reward functions are not bit-exact)."""


def zero_advantage(group: TrajectoryGroup, scaling: RewardScalingConfig | None = None) -> bool:
    """True when the group has two or more valid samples and all their rewards are equal (no advantage), after
    ``grpo.reward_scaling`` (its clamp may make rewards equal) and before shaping, as NeMo-RL's dynamic
    sampling judges them (:mod:`learner.reward_shaping`)."""
    rewards = [float(t.reward) for t in group.valid if t.reward is not None]
    if scaling is not None:
        rewards = scale_rewards(rewards, scaling).tolist()
    return len(rewards) >= 2 and max(rewards) - min(rewards) <= ZERO_ADVANTAGE_TOL


@dataclass
class BatchStats:
    """What :func:`batch_stats` found in one step's groups."""

    reward_function_means: dict[str, float] = field(default_factory=dict)
    """Mean of each reward function over the valid samples that report it, by function name."""

    def metrics(self) -> dict[str, float]:
        """The step row's keys."""
        return {f"reward_{name}_mean": v for name, v in sorted(self.reward_function_means.items())}


def batch_stats(groups: list[TrajectoryGroup]) -> BatchStats:
    """The statistics of ``groups`` (a step's trained groups)."""
    by_function: dict[str, list[float]] = defaultdict(list)
    for g in groups:
        for t in g.valid:
            for name, value in t.reward_components.items():
                by_function[name].append(float(value))
    return BatchStats({name: float(np.mean(v)) for name, v in by_function.items()})
