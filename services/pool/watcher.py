"""The pool's health watcher: every engine and the learner's channel, checked every few seconds.

Every ``HEALTH_PERIOD_S`` it checks the attached learner's channel (a learner
whose channel is gone is detached), then each engine in a task of its own, so
one engine restarting (tens of seconds while vLLM starts) does not hold up the
checks of the others. An engine whose vLLM is not running is marked down,
started again and brought to the pool's version (the kept object-store push,
``reset=True``) before it takes work; then waiting batches are sent. An answer
that comes late counts as down only ``HEALTH_TIMEOUTS_TO_DOWN`` times in a row.
An engine a scale-up adds goes through the same check at once (:meth:`HealthWatcher.admit`);
one a scale-down drains or removed is checked no more.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ray.exceptions import RayActorError

from services.pool.dispatch import Dispatcher
from services.pool.engine_replies import EngineHealth, EngineStats
from services.pool.fleet import CALL_TIMEOUT_S, Fleet

log = logging.getLogger("inflight.pool")
HEALTH_PERIOD_S = 5.0
HEALTH_TIMEOUT_S = CALL_TIMEOUT_S
HEALTH_TIMEOUTS_TO_DOWN = 3
"""Health checks in a row that may time out before an engine counts as down. An engine that is busy or starved
of CPU answers late; marking it down at once would make it flap (and re-form the weight group for nothing). A
dead process is noticed at once anyway: its calls fail with ``RayActorError``."""
LEARNER_CHECK = "learner"
"""The key of the learner channel's late checks (engine ids are ``<pool>-engine-<i>``)."""
START_TIMEOUT_S = 600.0
"""Longest an engine may take to start its vLLM engine again."""

Reinstall = Callable[[str], Awaitable[bool]]
"""Install the pool's kept push on an engine (``reset=True``); False if the pool keeps none (any more)."""


class HealthWatcher:
    def __init__(self, fleet: Fleet, dispatcher: Dispatcher, reinstall: Reinstall,
                 period_s: float = HEALTH_PERIOD_S, timeout_s: float = HEALTH_TIMEOUT_S):
        self.fleet, self.dispatcher, self.reinstall = fleet, dispatcher, reinstall
        self.period_s, self.timeout_s = period_s, timeout_s
        self.late_checks: dict[str, int] = {}
        """Health checks answered late in a row, by engine id (and ``LEARNER_CHECK``)."""
        self._counted: dict[str, dict] = {}
        self._checks: dict[str, asyncio.Task] = {}
        """The running (or last) check of each engine: at most one at a time per engine."""

    async def watch(self) -> None:
        """Every ``period_s``: check the learner, then each engine in a task of its own."""
        await self.fleet.ready.wait()
        try:
            while True:
                await asyncio.sleep(self.period_s)
                await self.check_learner()
                for eid in list(self._checks):
                    if eid not in self.fleet.handles:  # removed by a scale-down
                        self._checks.pop(eid).cancel()
                for eid in self.fleet.handles:
                    self._check_task(eid)
                self.dispatcher.send_waiting()
        finally:
            for task in self._checks.values():
                task.cancel()

    def _check_task(self, eid: str) -> asyncio.Task:
        """The running check of ``eid``, or a new one."""
        task = self._checks.get(eid)
        if task is None or task.done():
            task = self._checks[eid] = asyncio.get_running_loop().create_task(self.check_engine(eid))
        return task

    async def admit(self, eid: str) -> None:
        """A scale-up's new engine (already in ``fleet.handles``, booted): check it now as every period, which
        installs the pool's kept push on it (or, after a collective push, leaves it up but stale until the
        learner's next push brings it into the weight group) and marks it up; it takes work once it holds the
        pool's version. A check that fails leaves it down, retried every period."""
        await self._check_task(eid)

    async def check_engine(self, eid: str) -> None:
        """Health-check one engine; restart its vLLM engine if it is down and bring it to the pool's
        version before it takes work again. A draining or removed engine is not checked."""
        fleet, eng = self.fleet, self.fleet.handles.get(eid)
        if eng is None or (eid in fleet.table and fleet.table[eid].draining):
            return
        try:
            h = await self._health(eid)
            if h is None:
                return  # late, not yet HEALTH_TIMEOUTS_TO_DOWN times in a row
            if not h.ok:  # a new actor process, or vLLM's engine core died inside the actor
                why = h.error or "vLLM engine not running (actor restarted)"
                fleet.mark_down(eid, RuntimeError(f"{why}; starting it"))
                await asyncio.wait_for(eng.start.remote(), START_TIMEOUT_S)
                h = await asyncio.wait_for(eng.health.remote(), self.timeout_s)
                if not h.ok:
                    raise RuntimeError(f"vLLM engine still not serving after a restart: {h.error}")
            version = h.version
            # A restarted vLLM serves the model on disk: reinstall even if its version happens to match.
            if (h.version != fleet.version or not h.synced) and fleet.kept is not None:
                if await self.reinstall(eid):
                    version = fleet.version
                else:  # a collective push landed meanwhile and cleared the kept one
                    h = await asyncio.wait_for(eng.health.remote(), self.timeout_s)
                    version = h.version
            fleet.mark_up(eid, version, h.pid, h.incarnation)
            self._count(eid, await asyncio.wait_for(eng.stats.remote(), self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - recorded, retried next period
            fleet.mark_down(eid, exc)
        self.dispatcher.send_waiting()

    async def _health(self, eid: str) -> EngineHealth | None:
        """The engine's health; None if it answered late fewer than ``HEALTH_TIMEOUTS_TO_DOWN`` times in a row
        (the last such timeout is raised)."""
        try:
            h = await asyncio.wait_for(self.fleet.handles[eid].health.remote(), self.timeout_s)
        except TimeoutError:
            if self._tolerate_late(eid, f"engine {eid}"):
                return None
            raise
        self.late_checks[eid] = 0
        return h

    def _tolerate_late(self, key: str, what: str) -> bool:
        """Count one more late answer of ``key`` (an engine id, or ``LEARNER_CHECK``); True (logged) while
        fewer than ``HEALTH_TIMEOUTS_TO_DOWN`` came in a row: busy or starved of CPU, not yet gone."""
        late = self.late_checks[key] = self.late_checks.get(key, 0) + 1
        if late >= HEALTH_TIMEOUTS_TO_DOWN:
            return False
        log.warning("pool %s: %s did not answer its health check within %g s (%d in a row)", self.fleet.name,
                    what, self.timeout_s, late)
        return True

    async def check_learner(self) -> None:
        """A learner whose channel is gone (its job ended or was killed) is detached."""
        channel = self.dispatcher.channel
        if channel is None:
            return
        try:
            await asyncio.wait_for(channel.actor.size.remote(), self.timeout_s)
            self.late_checks[LEARNER_CHECK] = 0
        except TimeoutError:
            if not self._tolerate_late(LEARNER_CHECK, "the learner's channel"):
                self.dispatcher.detach()
        except RayActorError:
            self.dispatcher.detach()

    def _count(self, eid: str, stats: EngineStats) -> None:
        """Fold an engine's cumulative counters into the pool's Prometheus counters (deltas; a restarted
        engine starts from zero again)."""
        now_in = stats.incarnation
        seen = self._counted.setdefault(eid, {"incarnation": now_in})
        if seen["incarnation"] != now_in:
            seen.clear()
            seen["incarnation"] = now_in
        metrics, sampling, chat = self.fleet.metrics, stats.counters.sampling, stats.chat
        counters: list[tuple[str, float, Any]] = [
            ("tokens", sampling.tokens_generated, metrics.generation_tokens),
            ("groups", sampling.groups, metrics.groups_generated),
            ("spliced", chat.answers_spliced if chat else 0, metrics.openai_spliced),
            ("splice_refused", chat.splice_refused if chat else 0, metrics.openai_splice_refused)]
        if (env := stats.counters.env) is not None:  # a counter the environment does not keep is None
            label = {"env": env.name}
            counters += [(f"env:{key}", value, metrics.env_counters[key].labels(**label))
                         for key in metrics.env_counters if (value := getattr(env, key)) is not None]
            counters += [(f"env:calls:{outcome}", n, metrics.env_calls.labels(outcome=outcome, **label))
                         for outcome, n in (env.calls or {}).items()]
            if env.retries is not None:
                counters.append(("env:retries", env.retries, metrics.env_retries.labels(**label)))
        for key, now, counter in counters:
            before = seen.get(key, 0)
            if now > before:
                counter.inc(now - before)
            seen[key] = now
