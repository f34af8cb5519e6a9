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
    engine_call_seconds: float | None = None
    """Collective and CUDA IPC: the pool's calls to the engines, from sending them to the last answer."""
    engine_seconds: float | None = None
    """Collective and CUDA IPC: the longest an engine actor took to answer, from the call's start there."""
    engine_loop_lag_seconds: float | None = None
    """Collective and CUDA IPC: the longest an engine actor's event loop ran late since its previous install."""
    pool_loop_lag_seconds: float | None = None
    """The longest the pool replica's event loop ran late since the previous push (``services.pool.loop_lag``)."""

    def row(self) -> dict[str, float | str]:
        """The step row's ``refit_*`` columns (docs/operations.md): ``refit_s`` less ``refit_pool_s`` and
        ``refit_send_s`` is the learner's calls around them; ``refit_pool_s`` less ``refit_engine_call_s`` the
        pool's own part (its lock, the plan), that less ``refit_engine_s`` the calls' way to the engine actors,
        and ``refit_engine_s`` less ``refit_phase_total_s`` an engine's wait for its installer."""
        row: dict[str, float | str] = {"refit_pool_s": self.seconds}
        if self.pause_seconds_max is not None:
            row["refit_pause_s"] = self.pause_seconds_max
        if self.install_seconds_max is not None:
            row["refit_install_s"] = self.install_seconds_max
        if self.transport:
            row["refit_transport"] = self.transport
        timings = {"refit_send_s": self.send_seconds, "refit_engine_call_s": self.engine_call_seconds,
                   "refit_engine_s": self.engine_seconds, "refit_engine_loop_lag_s": self.engine_loop_lag_seconds,
                   "refit_pool_loop_lag_s": self.pool_loop_lag_seconds}
        row.update({k: v for k, v in timings.items() if v is not None})
        if self.phases is not None:  # where the engine's seconds went (rollout.install's PauseBreakdown)
            row.update({f"refit_phase_{k}": v for k, v in dataclasses.asdict(self.phases).items()})
        return row


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
    call_s: float = 0.0
    """The engine actor's time for the install call, from its start there to its answer."""
    loop_lag_s: float = 0.0
    """The longest the engine actor's event loop ran late since its previous install."""

    @classmethod
    def of(cls, version: int, installs: InstallStats, call_s: float = 0.0, loop_lag_s: float = 0.0) -> GroupInstall:
        """The install an engine just made, from its install counters (``RolloutEngine.counters().installs``)."""
        return cls(version=version, bytes=installs.refit_bytes_last, pause_s=installs.pause_seconds_last,
                   install_s=installs.install_seconds_last, install_path=installs.install_path_last,
                   drain_complete=installs.drain_complete_last, phases=dataclasses.replace(installs.phases_last),
                   call_s=call_s, loop_lag_s=loop_lag_s)


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
