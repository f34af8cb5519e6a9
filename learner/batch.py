"""One rollout batch as the learner trains it: valid samples, advantages, optimizer-step split.

:func:`collect` keeps the valid samples of every group with their group-relative
advantages (group mean or leave-one-out baseline) of their scaled and shaped
rewards (:mod:`learner.reward_shaping`), drops overlong samples from the loss when
``overlong_filtering`` is on (their reward stays in the baseline) and counts what
the metrics report; :func:`split` cuts the batch into the
samples of each optimizer step (trajectory positions ``[j·B, (j+1)·B)``).
See docs/learner.md, "A step" and "Several optimizer steps per batch".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from learner.config import TrainStepConfig
from learner.loss import group_advantages
from learner.reward_shaping import shaped_group_rewards
from protocol.messages import Trajectory, TrajectoryGroup


def _reward(t: Trajectory) -> float:
    if t.reward is None:
        raise ValueError("a valid trajectory (finish_reason != 'error') must carry a reward, got None")
    return float(t.reward)


@dataclass
class Sample:
    """One valid trajectory, ready to pack: prompt+response tokens and its per-token inputs."""

    tokens: np.ndarray
    prompt_len: int
    lp_gen: np.ndarray
    advantage: float
    position: int = 0
    """Its index among all the batch's trajectories (groups in order, failed ones counted): which
    optimizer step trains it (:func:`split`)."""


@dataclass
class StepBatch:
    """The samples of one global batch and the group-level counts."""

    samples: list[Sample]
    rewards: list[float]
    zero_advantage_groups: int
    failed_samples: int
    truncated_samples: int
    num_trajectories: int = 0
    """Every trajectory of the batch, failed ones included."""
    response_lengths: list[int] = field(default_factory=list)
    """Response length of every valid sample, as generated."""
    length_finished: int = 0
    """Valid samples with ``finish_reason == "length"``."""
    overlong_filtered: int = 0
    """Of those, the ones kept out of the loss (``overlong_filtering``)."""
    shaped_rewards: list[float] = field(default_factory=list)
    """The rewards the advantages were computed from (``grpo.reward_scaling`` / ``reward_shaping``), in the
    order of ``rewards``; equal to them when both are off."""
    reshaped: bool = False
    """Whether scaling or shaping was on (the metrics then report ``shaped_reward_*``)."""

    def reward_metrics(self) -> dict[str, float]:
        """``shaped_reward_{mean,min,max,std}`` when the rewards were scaled or shaped, else nothing."""
        return summary_stats(self.shaped_rewards, "shaped_reward") if self.reshaped else {}


def collect(groups: list[TrajectoryGroup], max_total_sequence_length: int, normalize_rewards: bool,
            cfg: TrainStepConfig) -> StepBatch:
    """The valid samples of ``groups`` with their advantages, and the batch's counts."""
    samples, rewards, lengths, shaped_all = [], [], [], []
    zero_groups = failed = truncated = length_finished = filtered = 0
    limit = max_total_sequence_length
    position = 0
    for g in groups:
        base = position
        position += len(g.trajectories)
        valid_at = [i for i, t in enumerate(g.trajectories) if t.ok]
        failed += len(g.trajectories) - len(valid_at)
        if not valid_at:
            continue
        valid = [g.trajectories[i] for i in valid_at]
        group_rewards = [_reward(t) for t in valid]
        shaped = shaped_group_rewards(group_rewards, [int(t.response_ids.size) for t in valid],
                                      [t.finish_reason == "length" for t in valid], cfg.reward_scaling,
                                      cfg.reward_shaping)
        shaped_all.extend(float(v) for v in shaped)
        advantages, no_signal = group_advantages(shaped, normalize_rewards, cfg.use_leave_one_out_baseline)
        zero_groups += int(no_signal)
        prompt = np.asarray(g.prompt_ids, dtype=np.int64)
        if prompt.size < 1 or prompt.size >= limit:
            raise ValueError(f"group {g.group_id}: prompt has {prompt.size} tokens, must be in "
                             f"[1, max_total_sequence_length={limit})")
        for i, t, reward, adv in zip(valid_at, valid, group_rewards, advantages, strict=True):
            rewards.append(reward)
            lengths.append(int(t.response_ids.size))
            overlong = t.finish_reason == "length"
            length_finished += int(overlong)
            if overlong and cfg.overlong_filtering:
                filtered += 1  # its reward is in the group's baseline above; no token in the loss
                continue
            room = limit - prompt.size
            resp, lp_gen = t.response_ids[:room], t.logprobs[:room]
            truncated += int(resp.size < t.response_ids.size)
            if resp.size == 0:
                continue
            samples.append(Sample(np.concatenate([prompt, resp.astype(np.int64)]), int(prompt.size),
                                  np.asarray(lp_gen, dtype=np.float32), float(adv), base + i))
    return StepBatch(samples, rewards, zero_groups, failed, truncated, position, lengths, length_finished,
                     filtered, shaped_all, cfg.reward_scaling.enabled or cfg.reward_shaping.enabled)


def split(batch: StepBatch, size: int | None) -> list[list[Sample]]:
    """The samples of each optimizer step: trajectories ``[j·B, (j+1)·B)`` of the batch (groups in order,
    then samples in order, failed ones counted) form step j; ``B = train_global_batch_size``."""
    total = batch.num_trajectories
    if size is None or size >= total:
        return [batch.samples]
    if total % size:
        raise ValueError(f"train_global_batch_size ({size}) must divide the batch's {total} trajectories "
                         f"(grpo.num_prompts_per_step x grpo.num_generations_per_prompt)")
    minis: list[list[Sample]] = [[] for _ in range(total // size)]
    for smp in batch.samples:
        minis[smp.position // size].append(smp)
    return minis


def summary_stats(values: list[float], prefix: str) -> dict[str, float]:
    """``{prefix}_mean/min/max/std`` (population std) of ``values``; zeros when empty."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {f"{prefix}_{k}": 0.0 for k in ("mean", "min", "max", "std")}
    return {f"{prefix}_mean": float(a.mean()), f"{prefix}_min": float(a.min()), f"{prefix}_max": float(a.max()),
            f"{prefix}_std": float(a.std())}
