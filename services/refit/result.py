"""What a weight push returns, and how a failed one is named.

:class:`RefitResult` is what the pool answers a learner's push with (both
transports); :class:`GroupInstall` what one engine answers a collective
install with. A push that fails raises :class:`RefitError`; its reason
(``timeout``, ``rejected``, ``failed``: the ``inflight_refit_failures`` label)
comes from the exception *types* of the engines' causes (:func:`failure_reason`),
looked up inside Ray's ``RayTaskError``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ray.exceptions import RayActorError, RayTaskError

from protocol import ProtocolError
from rollout.liveness import EngineDead
from rollout.weight_receiver import WeightUpdateError

FailureReason = Literal["timeout", "rejected", "failed"]


class RefitError(RuntimeError):
    """A weight push was rejected or did not complete on every engine."""


@dataclass(frozen=True)
class RefitResult:
    """One push, installed on every engine it went to."""

    version: int
    seconds: float
    """The pool's time for the push, from its call to the last engine's install."""
    bytes: int
    """Bytes of one copy of the weights."""
    engines: int
    """Engines that installed it."""
    pause_seconds_max: float | None = None
    """Collective only: the longest an engine's generation was paused for it."""
    install_seconds_max: float | None = None
    """Collective only: the longest an engine took to install it."""
    install_paths: tuple[str, ...] = ()
    """Collective only: how the engines installed it (see ``inflight_weight_installs``)."""
    send_seconds: float | None = None
    """Collective only: the learner's broadcast."""
    groups_formed: int | None = None
    """Collective only: weight groups the learner has formed so far."""


@dataclass(frozen=True)
class GroupInstall:
    """One engine's install of a collective push (see ``rollout.install.InstallStats``)."""

    version: int
    bytes: int
    pause_s: float
    install_s: float
    install_path: str


def remote_cause(exc: BaseException) -> BaseException:
    """The engine's own exception inside a ``RayTaskError`` (whose text is mostly a traceback)."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    return exc


def failure_reason(errors: list[BaseException]) -> FailureReason:
    """``timeout`` (a bucket or an engine did not answer in time), ``rejected`` (the push failed
    verification: missing bucket, bad checksum, shape, version) or ``failed`` (anything else)."""
    causes = [remote_cause(e) for e in errors]
    if any(isinstance(c, TimeoutError) for c in causes):
        return "timeout"
    if any(isinstance(c, (ProtocolError, WeightUpdateError)) for c in causes):
        return "rejected"
    return "failed"


def engine_gone(exc: BaseException) -> bool:
    """The engine actor's process died or is restarting, or its vLLM engine core died (the watcher restarts it)."""
    # RayActorError includes ActorUnavailableError (restarting)
    return isinstance(exc, RayActorError) or isinstance(remote_cause(exc), EngineDead)


def describe(exc: BaseException) -> str:
    cause = remote_cause(exc)
    return f"{type(cause).__name__}: {cause}"[:300]
