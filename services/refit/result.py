"""What a weight push returns, and how a failed one is named.

:class:`RefitResult` is what the pool answers a learner's push with (every
transport); :class:`GroupInstall` what one engine answers an install with
(:func:`services.refit.port.fold_installs` folds those answers into the pool's
version, table and metrics). A push that fails raises :class:`RefitError`; its
reason (``timeout``, ``rejected``, ``failed``: the ``inflight_refit_failures``
label) comes from the exception *types* of the engines' causes
(:func:`failure_reason`), looked up inside Ray's ``RayTaskError``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from ray.exceptions import RayActorError, RayTaskError

from protocol import ProtocolError
from rollout.install.installer import InstallStats, PauseBreakdown
from rollout.install.weight_receiver import WeightUpdateError
from rollout.liveness import EngineDead

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
    """The longest an engine's generation was paused for it."""
    install_seconds_max: float | None = None
    """The longest an engine took to install it."""
    install_paths: tuple[str, ...] = ()
    """Collective and CUDA IPC: how the engines installed it (see ``inflight_weight_installs``)."""
    send_seconds: float | None = None
    """Collective: the learner's broadcast; CUDA IPC: the learner's export (pack, checksums, shares)."""
    groups_formed: int | None = None
    """Collective only: weight groups the learner has formed so far."""
    transport: str = ""
    """How it went: ``object_store``, ``collective`` or ``cuda_ipc``."""
    phases: PauseBreakdown | None = None
    """Each phase's longest time over the engines (``rollout.install.installer.PauseBreakdown``)."""


@dataclass(frozen=True)
class GroupInstall:
    """One engine's install of a collective push (see ``rollout.install.installer.InstallStats``)."""

    version: int
    bytes: int
    pause_s: float
    install_s: float
    install_path: str
    drain_complete: bool = True
    """The streamed version marks counted every pre-pause token the front end still held (see
    ``inflight_version_drain_incomplete``)."""
    phases: PauseBreakdown | None = None

    @classmethod
    def of(cls, version: int, installs: InstallStats) -> GroupInstall:
        """The install an engine just made, from its install counters (``RolloutEngine.counters().installs``)."""
        return cls(version=version, bytes=installs.refit_bytes_last, pause_s=installs.pause_seconds_last,
                   install_s=installs.install_seconds_last, install_path=installs.install_path_last,
                   drain_complete=installs.drain_complete_last, phases=dataclasses.replace(installs.phases_last))


def slowest(phases: list[PauseBreakdown]) -> PauseBreakdown | None:
    """Each phase's longest time over ``phases``."""
    if not phases:
        return None
    return PauseBreakdown(**{f.name: max(getattr(p, f.name) for p in phases)
                             for f in dataclasses.fields(PauseBreakdown)})


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
