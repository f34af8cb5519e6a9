"""Fakes for the pool's parts: engine-actor handles, and the parts built on a fleet of them (no Ray, no Serve)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rollout.counters import EnvCounters, RolloutCounters
from rollout.install.installer import InstallStats
from rollout.kv_stats import KvCounters
from rollout.sampling import SamplingStats
from services.recipe.config import load_recipe
from services.pool.dispatch import Dispatcher
from services.pool.engine_replies import EngineHealth, EngineStats
from services.pool.fleet import Fleet
from services.pool.metrics import PoolMetrics
from services.pool.watcher import HealthWatcher
from services.refit.collective import WeightGroup
from services.refit.object_store import ObjectStoreFanout
from handle_fakes import ActorMethod


class FakeEngine:
    """``health``/``start``/``stats`` like an EngineActor handle; ``start`` can be held open."""

    def __init__(self, ok: bool):
        self.ok, self.health_calls, self.starts, self.slow, self.version = ok, 0, 0, False, 0
        self.release = asyncio.Event()
        self.health = ActorMethod(self._health)
        self.start = ActorMethod(self._start)
        self.stats = ActorMethod(self._stats)

    async def _health(self):
        self.health_calls += 1
        if self.slow:
            await asyncio.sleep(3600)
        return EngineHealth("fake", ok=self.ok, error="", version=self.version, synced=True, running_batches=0,
                            pid=1, incarnation=f"1.{self.starts}")

    async def _start(self):
        self.starts += 1
        await self.release.wait()  # vLLM takes tens of seconds to start
        self.ok = True

    async def _stats(self):
        return engine_stats(incarnation="1")


def engine_stats(tokens_generated: int = 0, groups: int = 0, *, incarnation: str = "1.1",
                 env: EnvCounters | None = None) -> EngineStats:
    """What an engine actor's ``stats`` answers: every counter 0 but those given."""
    counters = RolloutCounters("fake", 0, SamplingStats(tokens_generated=tokens_generated, groups=groups),
                               InstallStats(), KvCounters(), sleeps_skipped_on_cpu=0, weights_broken="",
                               vllm_unfinished_requests=0, env=env)
    return EngineStats("fake", 0, pid=1, incarnation=incarnation, running_batches=0, channel_send_failures=0,
                       counters=counters)


def fleet_of(engines: dict, version: int = 0) -> Fleet:
    """A booted fleet of ``engines`` (handles), every one up at ``version``."""
    fleet = Fleet(load_recipe(None, []), "/no/model", PoolMetrics())
    fleet.handles = dict(engines)
    for eid in engines:
        fleet.mark_up(eid, version, 1, "1.0")
    fleet.ready.set()
    return fleet


@dataclass
class Pool:
    """The parts a RolloutPool replica builds, without Serve."""

    fleet: Fleet
    dispatcher: Dispatcher
    fanout: ObjectStoreFanout
    group: WeightGroup
    watcher: HealthWatcher


def pool_of(engines: dict, period_s: float = 0.01, timeout_s: float = 10.0) -> Pool:
    fleet = fleet_of(engines)
    refit_timeout_s = fleet.recipe.policy.refit_timeout_s
    dispatcher, fanout = Dispatcher(fleet), ObjectStoreFanout(fleet, refit_timeout_s)
    return Pool(fleet, dispatcher, fanout, WeightGroup(fleet, refit_timeout_s),
                HealthWatcher(fleet, dispatcher, fanout.reinstall, period_s=period_s, timeout_s=timeout_s))
