"""Reward scaling and shaping: what turns a sample's raw reward into the reward its advantage is computed from.

Applied once per group, in :func:`learner.batch.collect`, in NeMo-RL's order (``grpo.py``: ``scale_rewards``,
then ``apply_reward_shaping``, then the advantages):

1. **scaling** (``grpo.reward_scaling``): ``r <- t_min + (clamp(r, s_min, s_max) - s_min) / (s_max - s_min)
   x (t_max - t_min)``; DAPO maps a {0, 1} verifier to {-1, 1}.
2. **shaping** (``grpo.reward_shaping``): DAPO's soft overlong punishment, ``r <- r + min(0, -(len - (L_max -
   L_buf)) / L_buf x penalty)`` with ``len`` the response's generated tokens; or, when
   ``stop_properly_penalty_coef`` is set, ``r <- coef x r`` for an answer cut at the length limit and nothing
   else.

The raw rewards stay the batch's ``reward_*`` metrics; the shaped ones are reported as ``shaped_reward_*``.
Dynamic sampling (:mod:`services.job.prompt_book`) judges a group on its scaled, unshaped rewards, as NeMo-RL
does (``std_rewards``): a group whose answers are all right is dropped even if their lengths differ.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from learner.config import RewardScalingConfig, RewardShapingConfig


def scale_rewards(rewards: Sequence[float], cfg: RewardScalingConfig) -> np.ndarray:
    """The linear map of ``grpo.reward_scaling`` (identity when off), float64."""
    r = np.asarray(rewards, dtype=np.float64)
    if not cfg.enabled:
        return r
    clamped = np.clip(r, cfg.source_min, cfg.source_max)
    return cfg.target_min + (clamped - cfg.source_min) / (cfg.source_max - cfg.source_min) * (
        cfg.target_max - cfg.target_min)


def shape_rewards(rewards: np.ndarray, response_lengths: Sequence[int], truncated: Sequence[bool],
                  cfg: RewardShapingConfig) -> np.ndarray:
    """``grpo.reward_shaping`` of (already scaled) rewards; ``truncated``: finished at the length limit."""
    if not cfg.enabled:
        return rewards
    if len(response_lengths) != rewards.size or len(truncated) != rewards.size:
        raise ValueError(f"{rewards.size} rewards, {len(response_lengths)} response lengths, {len(truncated)} "
                         f"truncation flags: one of each per sample")
    if cfg.stop_properly_penalty_coef is not None:
        return np.where(np.asarray(truncated, dtype=bool), rewards * cfg.stop_properly_penalty_coef, rewards)
    buf, penalty, top = cfg.overlong_buffer_length, cfg.overlong_buffer_penalty, cfg.max_response_length
    if buf is None or penalty is None or top is None:  # RewardShapingConfig refuses this; for the type checker
        raise ValueError("grpo.reward_shaping: the overlong penalty needs overlong_buffer_length, "
                         "overlong_buffer_penalty and max_response_length")
    exceed = np.asarray(response_lengths, dtype=np.float64) - (top - buf)
    return rewards + np.minimum(-exceed / buf * penalty, 0.0)


def shaped_group_rewards(rewards: Sequence[float], response_lengths: Sequence[int], truncated: Sequence[bool],
                         scaling: RewardScalingConfig, shaping: RewardShapingConfig) -> np.ndarray:
    """Scaling, then shaping, of one group's valid samples' rewards: what their advantages are computed from."""
    return shape_rewards(scale_rewards(rewards, scaling), response_lengths, truncated, shaping)
