"""What the rollout pool answers its learner's control calls with: typed values that cross Ray.

The pool's handle API answers validation with an :class:`EvaluationReply`
(groups, and the prompts that got none: :class:`FailedPrompt`) and hands a
learner the prompts its engines could not put into the learner's channel as
:class:`UndeliveredPrompt` s. The pool builds them, the job reads their fields:
neither wing names the other's types.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class UndeliveredPrompt:
    """A prompt whose group (or error report) an engine could not put into its learner's channel in time."""

    prompt_id: str
    scheduled_step: int
    reason: str
    """Why: the channel's refusal, or the engine's failure."""
    engine_id: str | None = None
    """The engine that gave up on it (set by the pool)."""


@dataclass(frozen=True)
class FailedPrompt:
    """A validation prompt that got no group."""

    prompt_id: str
    reason: str
    engine_id: str | None = None
    """The engine whose answer it was to be (None when that engine did not answer at all)."""


@dataclass
class EvaluationReply:
    """Validation's answer: one encoded ``TrajectoryGroup`` per prompt that got one, and those that did not."""

    groups: list[bytes] = field(default_factory=list)
    failed: list[FailedPrompt] = field(default_factory=list)
