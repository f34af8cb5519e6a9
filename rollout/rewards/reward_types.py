"""The reward-function interface: what a function is given (:class:`RewardInput`), what it returns (a float or a
:class:`RewardFailure` per sample), and what a scored sample is (:class:`Scored`, with each function's value)."""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RewardInput:
    """One sample to score."""

    text: str
    response_ids: Sequence[int]
    task: dict


@dataclass(frozen=True)
class RewardFailure:
    """A sample the reward function could not score, with the reason."""

    reason: str


@dataclass(frozen=True)
class Scored:
    """A scored sample: its reward and, for a weighted environment, each function's (unweighted) value."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)


RewardResult = float | RewardFailure
RewardFn = Callable[[list[RewardInput]], list[RewardResult] | Awaitable[list[RewardResult]]]
"""Scores a batch of samples; plain or ``async``; one result per sample."""
