"""What an episode asks of the engine that plays it: one turn sampled at a time (:class:`TurnSampler`).

:class:`rollout.sampling.GroupSampler` satisfies the protocol and hands :func:`rollout.episodes.episode.play_group`
its limits and counters, so the episodes wing never imports sampling: the two modules no longer import each
other, and a test can play episodes against any object with these three methods.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class SampledTurn:
    """What one finished request gave back: a single-turn answer, or one turn of an episode."""

    token_ids: list[int]
    logprobs: list[float]
    versions: np.ndarray
    finish_reason: str
    text: str
    routed_experts: np.ndarray | None = None
    """The experts the engine routed each position to (rollout/routed_experts.py); None when not asked for."""


@dataclass(frozen=True)
class EpisodeLimits:
    """How far an episode may run: the sampler's settings when its group starts."""

    max_turns: int
    """``grpo.max_rollout_turns``: the most turns an episode samples."""
    max_model_len: int
    """Prompt + every sampled turn and environment message of one episode, in tokens."""
    max_new_tokens: int
    """The most tokens one turn samples (``generation.max_new_tokens``)."""
    truncated_reward: float | None
    """The reward of an episode cut by ``max_turns`` or ``max_model_len`` before the environment was done (its
    finish reason is ``"length"``); None: such an episode fails."""


class EpisodeCounters(Protocol):
    """The sampling counters an episode adds to (:class:`rollout.sampling.SamplingStats` has them)."""

    episodes: int
    samples_ok: int
    samples_failed: int
    tokens_generated: int
    turns: int
    env_tokens: int
    env_failures: int
    episodes_truncated: int
    env_wait_seconds: float


class TurnSampler(Protocol):
    """The engine's side of an episode: sample one turn (with its retries), and say whether the engine died."""

    async def sample_turn(self, token_ids: list[int], budget: int, prompt_id: str, index: int, turn: int,
                          temperature: float | None = None) -> SampledTurn | Exception:
        """Turn ``turn`` of sample ``index``: at most ``budget`` tokens after ``token_ids`` (the prompt and the
        episode so far); the failure, once retries run out, is returned, not raised."""
        ...

    def check_alive(self, prompt_id: str) -> None:
        """After a turn failed: raise if the engine itself has died (the group is not returned)."""
        ...

    def no_room(self, prompt_len: int) -> str:
        """Why a prompt of ``prompt_len`` tokens cannot be answered: it fills ``max_model_len``."""
        ...
