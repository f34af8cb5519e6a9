"""What a weight push returns, and how a failed one is named.

:class:`RefitResult` is what the pool answers a learner's push with (both
transports); :class:`GroupInstall` what one engine answers an install
with, and :func:`fold_installs` how the pool folds those answers into its
version, table and metrics. A push that fails raises :class:`RefitError`; its reason
(``timeout``, ``rejected``, ``failed``: the ``inflight_refit_failures`` label)
comes from the exception *types* of the engines' causes (:func:`failure_reason`),
looked up inside Ray's ``RayTaskError``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ray.exceptions import RayActorError, RayTaskError

from protocol import ProtocolError
from rollout.install import PauseBreakdown
from rollout.liveness import EngineDead
from rollout.weight_receiver import WeightUpdateError

if TYPE_CHECKING:
    from services.pool.fleet import Fleet

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
    """Each phase's longest time over the engines (``rollout.install.PauseBreakdown``)."""


@dataclass(frozen=True)
class GroupInstall:
    """One engine's install of a collective push (see ``rollout.install.InstallStats``)."""

    version: int
    bytes: int
    pause_s: float
    install_s: float
    install_path: str
    drain_complete: bool = True
    """The front end delivered every pre-pause output in time (streamed labels; see
    ``inflight_version_drain_incomplete``)."""
    phases: PauseBreakdown | None = None

    @classmethod
    def from_stats(cls, version: int, stats: dict[str, Any]) -> GroupInstall:
        """The install an engine just made, from its ``RolloutEngine.stats()``."""
        return cls(version=version, bytes=stats["refit_bytes_last"], pause_s=stats["pause_seconds_last"],
                   install_s=stats["install_seconds_last"], install_path=stats["install_path_last"],
                   drain_complete=stats["drain_complete_last"],
                   phases=PauseBreakdown(**stats["phases_last"]))


def slowest(phases: list[PauseBreakdown]) -> PauseBreakdown | None:
    """Each phase's longest time over ``phases``."""
    if not phases:
        return None
    return PauseBreakdown(**{f.name: max(getattr(p, f.name) for p in phases)
                             for f in dataclasses.fields(PauseBreakdown)})


def engine_failures(fleet: Fleet, eids: list[str], results: list) -> dict[str, BaseException]:
    """The engines of a call to several that failed; those whose process died are marked down (the watcher
    brings them back, and the next push leaves them out until then)."""
    failed = {e: r for e, r in zip(eids, results, strict=True) if isinstance(r, BaseException)}
    for eid, exc in failed.items():
        if engine_gone(exc):
            fleet.mark_down(eid, exc)
    return failed


def fold_installs(fleet: Fleet, eids: list[str], results: list[GroupInstall], seconds: float,
                  transport: str) -> RefitResult:
    """Every engine of ``eids`` installed its push (``results``, in order): advance each engine and the pool
    (which keeps no push: an engine that restarts waits for the learner's next one) and count it."""
    for eid, res in zip(eids, results, strict=True):
        fleet.table.set_version(eid, res.version)
    version = results[0].version
    fleet.version, fleet.kept = version, None
    m = fleet.metrics
    m.policy_version.set(version)
    m.refit_seconds.observe(seconds)
    m.refit_bytes.inc(sum(r.bytes for r in results))
    for r in results:
        record_install_metrics(fleet, r)
    return RefitResult(version=version, seconds=seconds, bytes=max(r.bytes for r in results), engines=len(eids),
                       pause_seconds_max=max(r.pause_s for r in results),
                       install_seconds_max=max(r.install_s for r in results),
                       install_paths=tuple(sorted({r.install_path for r in results})), transport=transport,
                       phases=slowest([r.phases for r in results if r.phases is not None]))


def record_install_metrics(fleet: Fleet, install: GroupInstall, held: bool = True) -> None:
    """One engine's install in the pool's metrics: an incomplete drain and its phases; for a push the workers
    held (``held``: weight group, CUDA IPC) also its pause and install path."""
    m = fleet.metrics
    if held:
        m.refit_pause_seconds.observe(install.pause_s)
        m.weight_installs.labels(path=install.install_path).inc()
    if not install.drain_complete:
        m.version_drain_incomplete.inc()
    if install.phases is not None:
        for f in dataclasses.fields(PauseBreakdown):
            m.refit_phase_seconds.labels(phase=f.name.removesuffix("_s")).set(getattr(install.phases, f.name))


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
