"""A pool as the weight transports see it (``services.refit.port.PoolPort``), in memory: no Fleet, no Ray."""
from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.pool.loop_lag import LoopLag
from services.refit.port import EngineHandle, KeptPush
from services.refit.result import RefitError, describe, failure_reason


class FakeMetrics:
    """The metric families a push updates (``RefitMetrics``), and the failed pushes by reason."""

    def __init__(self) -> None:
        r = CollectorRegistry()
        self.refit_seconds = Histogram("refit_seconds", "", registry=r)
        self.refit_bytes = Counter("refit_bytes", "", registry=r)
        self.refit_pause_seconds = Histogram("refit_pause_seconds", "", registry=r)
        self.refit_phase_seconds = Gauge("refit_phase_seconds", "", ["phase"], registry=r)
        self.weight_installs = Counter("weight_installs", "", ["path"], registry=r)
        self.version_drain_incomplete = Counter("version_drain_incomplete", "", registry=r)
        self.refit_failures = Counter("refit_failures", "", ["reason"], registry=r)


class FakePool:
    """Engines by id, each up at version 0 with incarnation ``<i>.1``; records what the transports tell it."""

    def __init__(self, engines: dict[str, EngineHandle]):
        self.name = "p"
        self.refit_lock = asyncio.Lock()
        self.loop_lag = LoopLag()
        self.version = 0
        self.kept: KeptPush | None = None
        self.handles = dict(engines)
        self.metrics = FakeMetrics()
        self.versions: dict[str, int | None] = dict.fromkeys(engines, 0)
        """Engine id -> the version it installed."""
        self.incarnations: dict[str, str | None] = {e: f"{i}.1" for i, e in enumerate(engines)}
        self.down: dict[str, BaseException] = {}
        """Engines the transports marked down -> why."""

    def restarted(self, eid: str, handle: EngineHandle, incarnation: str) -> None:
        """``eid`` (new, or restarted) is up at version 0 with a new incarnation."""
        self.handles[eid], self.versions[eid], self.incarnations[eid] = handle, 0, incarnation
        self.down.pop(eid, None)

    def engines_up(self) -> list[str]:
        return [e for e in self.handles if e not in self.down]

    def engine_version(self, eid: str) -> int | None:
        return self.versions[eid]

    def incarnation(self, eid: str) -> str | None:
        return self.incarnations[eid]

    async def some_engine_up(self, timeout_s: float) -> None:
        pass

    def installed(self, eid: str, version: int) -> None:
        self.versions[eid] = version

    def advance(self, version: int, kept: KeptPush | None) -> None:
        self.version, self.kept = version, kept

    def mark_down(self, eid: str, exc: BaseException) -> None:
        self.down[eid] = exc

    def refit_failed(self, version: int | str, failed: dict[str, BaseException]) -> RefitError:
        why = failure_reason(list(failed.values()))
        self.metrics.refit_failures.labels(reason=why).inc()
        return RefitError(f"weight push v{version} {why}: { {w: describe(e) for w, e in failed.items()} }")
