"""The pool as a weight push sees it: :class:`PoolPort`, and the steps every push takes on it.

The pool halves of the transports take a :class:`PoolPort` (the pool's
``Fleet`` implements it), never the pool itself: the refit lock, the engines
that are up with their handles, versions and incarnations, the version the pool
serves, marking an engine down, recording a failed push and the metric families
a push updates (:class:`RefitMetrics`). The shared steps of a push that lands or
fails on some engines (:func:`engine_failures`, :func:`fold_installs`,
:func:`land`, :func:`record_install_metrics`) are here, on the port.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Gauge, Histogram

from rollout.install.installer import PauseBreakdown
from services.refit.result import GroupInstall, RefitResult, engine_gone, slowest

if TYPE_CHECKING:
    from services.refit.result import RefitError

EngineHandle = Any
"""A Ray actor handle of one of the pool's engine actors (its install calls go through ``.remote``)."""


@dataclass(frozen=True)
class KeptPush:
    """The last object-store push: its manifest and the pool's own copy of its buckets."""

    manifest_bytes: bytes
    refs: list


class RefitMetrics(Protocol):
    """The pool's metric families a push updates (``inflight_refit_*``, ``inflight_weight_installs``,
    ``inflight_version_drain_incomplete``)."""

    refit_seconds: Histogram
    """Seconds of one push, from the pool's call to the last engine's install."""
    refit_bytes: Counter
    """Bytes the engines installed."""
    refit_pause_seconds: Histogram
    """Seconds an engine's generation was paused for one push the workers held."""
    refit_phase_seconds: Gauge
    """Each phase of the last install on an engine, labelled ``phase``."""
    weight_installs: Counter
    """Installs of a push the workers held, labelled ``path``."""
    version_drain_incomplete: Counter
    """Installs whose streamed version marks could not count the front end's pre-pause backlog."""


class LoopWatch(Protocol):
    """How late the pool replica's event loop runs (``services.pool.loop_lag.LoopLag``, watching from the pool's
    start)."""

    def take(self) -> float:
        """The longest lag since the previous call; starts over."""
        ...


class PoolPort(Protocol):
    """What a push needs from the pool it installs on (``services.pool.fleet.Fleet`` implements it)."""

    @property
    def name(self) -> str:
        """The pool's name (for logs)."""
        ...

    @property
    def refit_lock(self) -> asyncio.Lock:
        """Held by every install (and by a scale-down forgetting engines): one push at a time."""
        ...

    @property
    def loop_lag(self) -> LoopWatch:
        """How late the pool replica's event loop runs (reported with each push)."""
        ...

    @property
    def version(self) -> int:
        """The version the pool serves: advances only when a push landed on every engine it went to."""
        ...

    @property
    def kept(self) -> KeptPush | None:
        """The last object-store push, reinstalled on engines that restart; None after any other push."""
        ...

    @property
    def handles(self) -> Mapping[str, EngineHandle]:
        """Engine id -> its actor handle."""
        ...

    @property
    def metrics(self) -> RefitMetrics:
        ...

    def engines_up(self) -> list[str]:
        """Engines that are up (draining ones too: they install pushes while they finish their batches)."""
        ...

    def engine_version(self, eid: str) -> int | None:
        """The version ``eid`` last installed (or booted with)."""
        ...

    def incarnation(self, eid: str) -> str | None:
        """``eid``'s process and vLLM start (changes when either restarts)."""
        ...

    async def some_engine_up(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for an engine to be up (call it outside the refit lock: the engine that
        restarts needs the lock to come back)."""
        ...

    def installed(self, eid: str, version: int) -> None:
        """``eid`` installed ``version``."""
        ...

    def advance(self, version: int, kept: KeptPush | None) -> None:
        """The pool serves ``version`` from now on and keeps ``kept`` for engines that restart (None: keeps no
        weights; a restarted engine waits for the learner's next push)."""
        ...

    def mark_down(self, eid: str, exc: BaseException) -> None:
        """``eid``'s process or vLLM engine died (the health watcher brings it back)."""
        ...

    def refit_failed(self, version: int | str, failed: dict[str, BaseException]) -> RefitError:
        """Count a rejected or failed push (its reason from the causes in ``failed``: where -> error) and
        describe it; the caller raises the error."""
        ...


def engine_failures(pool: PoolPort, eids: list[str], results: list) -> dict[str, BaseException]:
    """The engines of a call to several that failed; those whose process died are marked down (the watcher
    brings them back, and the next push leaves them out until then)."""
    failed = {e: r for e, r in zip(eids, results, strict=True) if isinstance(r, BaseException)}
    for eid, exc in failed.items():
        if engine_gone(exc):
            pool.mark_down(eid, exc)
    return failed


def land(pool: PoolPort, version: int, seconds: float, bytes_installed: int, kept: KeptPush | None) -> None:
    """Every engine the push went to installed ``version``: the pool serves it (keeping ``kept``) and counts
    the push (``seconds``; ``bytes_installed`` over all engines)."""
    pool.advance(version, kept)
    pool.metrics.refit_seconds.observe(seconds)
    pool.metrics.refit_bytes.inc(bytes_installed)


def fold_installs(pool: PoolPort, eids: list[str], results: list[GroupInstall], seconds: float,
                  transport: str, engine_call_s: float) -> RefitResult:
    """Every engine of ``eids`` installed a push the workers held (``results``, in order; the calls took
    ``engine_call_s``): advance each engine and the pool (which keeps no push: an engine that restarts waits
    for the learner's next one) and count it."""
    for eid, res in zip(eids, results, strict=True):
        pool.installed(eid, res.version)
    version = results[0].version
    land(pool, version, seconds, sum(r.bytes for r in results), kept=None)
    for r in results:
        record_install_metrics(pool.metrics, r)
    return RefitResult(version=version, seconds=seconds, bytes=max(r.bytes for r in results), engines=len(eids),
                       pause_seconds_max=max(r.pause_s for r in results),
                       install_seconds_max=max(r.install_s for r in results),
                       install_paths=tuple(sorted({r.install_path for r in results})), transport=transport,
                       phases=slowest([r.phases for r in results if r.phases is not None]),
                       engine_call_seconds=engine_call_s, engine_seconds=max(r.call_s for r in results),
                       engine_loop_lag_seconds=max(r.loop_lag_s for r in results),
                       pool_loop_lag_seconds=pool.loop_lag.take())


def record_install_metrics(metrics: RefitMetrics, install: GroupInstall, held: bool = True) -> None:
    """One engine's install in the pool's metrics: an incomplete drain and its phases; for a push the workers
    held (``held``: weight group, CUDA IPC) also its pause and install path."""
    if held:
        metrics.refit_pause_seconds.observe(install.pause_s)
        metrics.weight_installs.labels(path=install.install_path).inc()
    if not install.drain_complete:
        metrics.version_drain_incomplete.inc()
    if install.phases is not None:
        for f in dataclasses.fields(PauseBreakdown):
            metrics.refit_phase_seconds.labels(phase=f.name.removesuffix("_s")).set(getattr(install.phases, f.name))
