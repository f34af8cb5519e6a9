"""What the rollout pool answers its handle's callers with: typed values that cross Ray.

The pool's handle API answers validation with an :class:`EvaluationReply`
(groups, and the prompts that got none: :class:`FailedPrompt`), hands a
learner the prompts its engines could not put into the learner's channel as
:class:`UndeliveredPrompt` s, and says what it is with a :class:`PoolStatus`
(its engines: :class:`EngineStatus`; ``GET /v1/status`` serves its JSON), and
answers ``engine_stats`` with an :class:`EngineStatsReply` per engine. The
pool builds them, the job and the CLI read their fields: neither wing names
the other's types.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


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


@dataclass(frozen=True)
class EngineStatus:
    """One engine as the pool's status shows it."""

    up: bool
    """It answered its last health check (or its boot) and may take work."""
    version: int | None
    """The policy version it serves."""
    pid: int | None
    incarnation: str | None
    """``<pid>.<vLLM starts>``: changes when its process or its vLLM engine restarts."""
    error: str | None
    """Why it is down (None while up)."""
    starting: bool
    """A scale-up is booting it."""
    draining: bool
    """A scale-down is removing it."""
    state: str
    """``starting``, ``up``, ``stale`` (up at another version), ``draining`` or ``down``."""


@dataclass(frozen=True)
class EngineStatsReply:
    """One engine's answer to the pool's ``engine_stats``: what it has installed, and its counters (or why it did
    not answer)."""

    engine_id: str
    """The engine actor's name (``<pool>-engine-<i>``)."""
    error: str | None = None
    """Why it did not answer (its call's exception, shortened); None when it did. With an error, the fields below
    are unknown: None, and no counters."""
    version: int | None = None
    """The policy version its vLLM engine serves (0: the model on disk)."""
    pid: int | None = None
    """The engine actor's process id."""
    incarnation: str | None = None
    """``<pid>.<vLLM starts>``: changes when its process or its vLLM engine restarts (its counters start again)."""
    refits: int | None = None
    """Pushes installed since its vLLM engine started."""
    counters: dict[str, Any] = field(default_factory=dict)
    """Every count it keeps, by the flat key of the engine's stats: the rollout engine's (``samples_ok``,
    ``retries``, ``aborts``, ``refits``, ..., ``env`` when it plays episodes), then the chat serving's and the
    actor's (``channel_send_failures``, ``running_batches``, ``pid``, ``incarnation``); the fields above are
    there too. Empty with an error."""


@dataclass(frozen=True)
class AttachedLearner:
    """The learner job attached to the pool."""

    id: str
    since: float
    """When it attached (Unix time)."""


@dataclass(frozen=True)
class PoolStatus:
    """What the pool says of itself (``status``; ``GET /v1/status`` serves :meth:`to_json`)."""

    name: str
    version: int
    """The policy version the pool serves."""
    ready: bool
    """Every engine that is not starting or draining is up at a known version."""
    pid: int
    learner: AttachedLearner | None
    paused: bool
    draining: bool
    engines: dict[str, EngineStatus]
    uptime_s: float
    requeued_prompts: int
    """Prompts re-sent after their engine died, since the pool started."""
    waiting_prompts: int
    """Prompts waiting for an engine at the pool's version."""
    undelivered_prompts: int
    """Prompts kept for the attached learner that its channel did not take."""
    errors: list[str]
    """The last few errors (start-up, refit, scale)."""
    last_report: dict | None
    """The attached learner's last step report, without its per-group lists."""

    def to_json(self) -> dict:
        """The JSON object of ``/v1/status`` and ``inflight pool status --json``: a non-finite number (a skipped
        step's NaN ``grad_norm``) becomes null, which strict JSON encoders (Starlette's) accept."""
        return _finite(asdict(self))


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float, at any depth of dicts and lists, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
