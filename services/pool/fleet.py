"""The pool's engines and what every part of the pool shares about them.

A :class:`Fleet` holds the engine actors' handles, the :class:`EngineTable`, the
version the pool serves, the last object-store push it keeps for engines that
restart, the refit lock every install takes, and the errors ``status`` shows.
It boots the engines (:mod:`services.pool.startup`), scales their number while
the pool serves (:meth:`Fleet.scale`), shuts them down, and runs the calls that
go to every engine (sleep, wake, stats, log-probs). Dispatch and the health
watcher work on it; the weight transports see it as their port
(:class:`services.refit.port.PoolPort`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError

from protocol.pool_replies import EngineStatsReply
from services.pool.engine_table import STATES, EngineTable
from services.pool.loop_lag import LoopLag
from services.pool.metrics import PoolMetrics
from services.pool.placement import colocation_group
from services.pool.startup import (
    BOOT_TIMEOUT_S,
    ENGINE_NAMESPACE,
    boot_engines,
    create_engines,
    discard_engines,
    engine_name,
    reason,
)
from services.recipe.gpu_layout import PlacementError, colocated_on_gpus
from services.refit.port import KeptPush
from services.refit.result import RefitError, describe, failure_reason

if TYPE_CHECKING:
    from services.pool.agent_driver import PoolAccess
    from services.pool.engine_replies import EngineStarted, EngineStats
    from services.recipe.config import Recipe

log = logging.getLogger("inflight.pool")
EngineHandle = Any
"""A Ray actor handle of :class:`services.pool.engine_actor.EngineActor`."""
CALL_TIMEOUT_S = 10.0
"""Longest a cheap engine call (health, stats, group size) may take."""


MAX_DRAIN_TIMEOUT_S = 3600.0
"""Longest a scale-down waits for a removed engine's batches (its default: ``policy.generation.request_timeout_s``,
capped here)."""
NAME_FREED_TIMEOUT_S = 30.0
"""Longest a removed engine's actor name may take to be free again (a scale-up right after a scale-down must
create a new actor, not find the dying one)."""
Admit = Callable[[str], Awaitable[None]]
"""Bring a new engine to the pool's version and mark it up (:meth:`services.pool.watcher.HealthWatcher.admit`)."""
Drain = Callable[[list[str], float], Awaitable[int]]
"""Stop giving engines work, let their batches finish within a bound, hand back the rest; returns the prompts
handed back (:meth:`services.pool.dispatch.Dispatcher.drain`)."""


class ScaleRequestError(ValueError):
    """A scale request with a value the pool does not take (engines out of bounds, a layout that cannot be)."""


class ScaleError(RuntimeError):
    """A scale request the pool refused (``refused``: nothing changed) or could not carry out (``failed``: the
    engines it was adding were removed again)."""

    def __init__(self, message: str, outcome: Literal["refused", "failed"]):
        super().__init__(message)
        self.outcome = outcome

    def __reduce__(self):  # through Ray (a handle call's error) with its outcome
        return type(self), (str(self), self.outcome)


@dataclass(frozen=True)
class ScaleResult:
    """What one scale request did."""

    engines_before: int
    engines: int
    """Engines of the pool now."""
    added: list[str]
    removed: list[str]
    handed_back_prompts: int
    """Prompts of the removed engines' batches that did not finish within the drain bound, re-queued to the
    others (their learner ignores a group that comes twice)."""
    seconds: float
    states: dict[str, str]
    """Engine id -> its state (:data:`services.pool.engine_table.STATES`) when the request ended."""


class Fleet:
    def __init__(self, recipe: Recipe, model_path: Any, metrics: PoolMetrics, access: PoolAccess | None = None):
        self.recipe, self.name, self.model_path, self.metrics = recipe, recipe.rollout_pool.name, model_path, metrics
        self.access = access
        """Where the engines' agents reach the pool (``env.<name>.agent``); None: the pool was made without it."""
        self.handles: dict[str, EngineHandle] = {}
        self.table = EngineTable()
        self.version = 0
        self.kept: KeptPush | None = None
        """Reinstalled on engines that restart; None after a collective push (the pool keeps no weights then)."""
        self.refit_lock = asyncio.Lock()
        self.loop_lag = LoopLag()
        """How late this replica's event loop runs (watched from :meth:`start` on, reported with each push)."""
        self.errors: list[str] = []
        self.ready = asyncio.Event()
        self.colocation: Any = None
        self.started_at = time.time()
        self._scale_task: asyncio.Future[ScaleResult] | None = None
        for state in STATES:  # read at every scrape
            metrics.engines.labels(state=state).set_function(lambda s=state: self.table.counts(self.version)[s])

    async def start(self) -> None:
        """Place, create and boot the engines. Any error stops the start-up at once and removes what it made
        (engines, colocation group); the reason goes to ``errors`` and ``ready`` is set either way, so
        ``wait_ready`` answers at once and :func:`services.pool.deploy` fails with the reason."""
        self.loop_lag.start()
        started: dict[str, EngineStarted] = {}
        try:
            self.colocation = await asyncio.to_thread(colocation_group, self.recipe, self.name)
            create_engines(self.recipe, self.name, self.model_path, self.colocation, into=self.handles,
                           access=self.access)
            self._adopt_scaled_engines()
            await boot_engines(self.handles, BOOT_TIMEOUT_S, started, self.recipe)
            for eid in self.handles:
                res = started[eid]
                self.mark_up(eid, res.version, res.pid, res.incarnation)
            self.metrics.policy_version.set(self.version)
        except Exception as exc:  # noqa: BLE001 - any start-up error fails the deploy, leaving nothing behind
            why = f"start-up failed: {reason(exc)}"[:500]
            log.error("pool %s: %s; removing its engines and placement group", self.name, why)
            self.errors.append(why)
            self.errors.extend(await discard_engines(self.handles, set(started), self.colocation))
            self.colocation = None
        finally:
            self.ready.set()

    def _adopt_scaled_engines(self) -> None:
        """A restarted pool replica keeps the engines a scale-up had added beyond ``rollout_pool.num_engines``
        (named, detached actors: ``<pool>-engine-<n>``, ``<n>`` from ``num_engines`` up, without gaps)."""
        import ray

        while True:
            eid = engine_name(self.name, len(self.handles))
            try:
                self.handles[eid] = ray.get_actor(eid, namespace=ENGINE_NAMESPACE)
            except ValueError:
                break
            log.info("pool %s: engine %s of an earlier scale-up is still there; keeping it", self.name, eid)
        if len(self.handles) != self.recipe.rollout_pool.num_engines:
            self.recipe = self.scaled_recipe(len(self.handles))

    def mark_up(self, eid: str, version: int, pid: int | None, incarnation: str | None) -> None:
        if eid in self.handles:  # not an engine a scale-down removed meanwhile
            self.table.mark_up(eid, version, pid, incarnation)
            self.metrics.engine_up.labels(engine=eid).set(1)

    # ------------------------------------------------------------ the weight transports' port (PoolPort)
    def engines_up(self) -> list[str]:
        return self.table.up()

    def engine_version(self, eid: str) -> int | None:
        return self.table[eid].version

    def incarnation(self, eid: str) -> str | None:
        return self.table[eid].incarnation

    def installed(self, eid: str, version: int) -> None:
        self.table.set_version(eid, version)

    def advance(self, version: int, kept: KeptPush | None) -> None:
        self.version, self.kept = version, kept
        self.metrics.policy_version.set(version)

    def mark_down(self, eid: str, exc: BaseException) -> None:
        if eid in self.handles:
            self.table.mark_down(eid, f"{type(exc).__name__}: {exc}"[:300])
            self.metrics.engine_up.labels(engine=eid).set(0)

    def refit_failed(self, version: int | str, failed: dict[str, BaseException]) -> RefitError:
        """Count a rejected or failed push (``inflight_refit_failures{reason}``) and describe it."""
        why = failure_reason(list(failed.values()))
        self.metrics.refit_failures.labels(reason=why).inc()
        detail = {where: describe(e) for where, e in failed.items()}
        self.errors.append(f"refit v{version} {why}: {detail}"[:300])
        return RefitError(f"pool {self.name!r}: weight push v{version} {why}; the old version "
                          f"v{self.version} keeps serving: {detail}")

    def serving(self) -> list[str]:
        """Engines that take work: up at the pool's version."""
        return self.table.serving(self.version)

    def is_ready(self) -> bool:
        return self.ready.is_set() and self.table.all_serving()

    async def some_engine_up(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` until an engine is up (the only one may be restarting: the watcher
        needs the refit lock to bring it back, so callers wait here outside it)."""
        deadline = time.monotonic() + timeout_s
        while not self.table.up():
            if time.monotonic() > deadline:
                return  # the push then fails with "no engine is up"
            await asyncio.sleep(1.0)

    async def logprobs_of(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                          engine_id: str | None = None, image_prompts: list[bytes] | None = None) -> list[list[float]]:
        eid = engine_id or (self.serving() or list(self.handles))[0]  # default: the first healthy engine
        return await asyncio.wait_for(self.handles[eid].logprobs_of.remote(prompt_ids, response_ids, image_prompts),
                                      self.recipe.policy.generation.request_timeout_s)

    async def sleep(self) -> None:
        await asyncio.gather(*[e.sleep.remote() for e in self.handles.values()])

    async def wake(self) -> None:
        await asyncio.gather(*[e.wake_up.remote() for e in self.handles.values()])

    async def engine_stats(self) -> dict[str, EngineStatsReply]:
        """Each engine's :class:`EngineStatsReply` (:meth:`EngineStats.reply`: the pool's answer to its callers,
        read by attribute in the job wing), with only its ``error`` if it did not answer."""
        out = {}
        for eid, eng in self.handles.items():
            try:
                stats: EngineStats = await asyncio.wait_for(eng.stats.remote(), CALL_TIMEOUT_S)
                out[eid] = stats.reply()
            except Exception as exc:  # noqa: BLE001
                out[eid] = EngineStatsReply(eid, error=repr(exc)[:200])
        return out

    # ------------------------------------------------------------ scaling
    async def scale(self, engines: int, admit: Admit, drain: Drain, drain_timeout_s: float | None = None
                    ) -> ScaleResult:
        """Add or remove engines until the pool has ``engines`` while it serves. Adding: the new engines are
        placed and booted as at deploy, then admitted (``admit``: the pool's version installed, then up); one
        that does not boot fails the request and every engine it was adding is removed. Removing (the highest
        engine numbers): ``drain`` them (no new work, in-flight batches finish within ``drain_timeout_s``,
        default ``policy.generation.request_timeout_s``, at most :data:`MAX_DRAIN_TIMEOUT_S`; the rest are
        handed back), then stop them. One request at a time; the work goes on if the caller goes away.
        Raises :class:`ScaleRequestError` or :class:`ScaleError`; every request is counted in
        ``inflight_pool_scale_events{direction,outcome}``."""
        before = len(self.handles)
        direction = "up" if engines > before else "down" if engines < before else "none"
        if not self.ready.is_set() or not self.handles:
            self._refuse(direction, f"pool {self.name!r} is not serving yet (still starting, or its start-up "
                                    f"failed): nothing to scale")
        if self._scale_task is not None and not self._scale_task.done():
            self._refuse(direction, f"pool {self.name!r}: another scale request is in progress; wait for it "
                                    f"(`inflight pool status` shows engines starting or draining)")
        task = self._scale_task = asyncio.ensure_future(self._scale_counted(engines, direction, admit, drain,
                                                                            drain_timeout_s))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, if its caller went away
        return await asyncio.shield(task)  # a caller that goes away leaves no engine half-made

    def _refuse(self, direction: str, why: str) -> None:
        self.metrics.scale_events.labels(direction=direction, outcome="refused").inc()
        raise ScaleError(why, "refused")

    async def _scale_counted(self, engines: int, direction: str, admit: Admit, drain: Drain,
                             drain_timeout_s: float | None) -> ScaleResult:
        outcome = "failed"
        try:
            result = await self._scale(engines, admit, drain, drain_timeout_s)
            outcome = "done"
            return result
        except ScaleError as exc:
            outcome = exc.outcome
            if outcome == "failed":
                self.errors.append(f"scale to {engines} engines failed: {exc}"[:300])
            raise
        except ScaleRequestError:
            outcome = "refused"
            raise
        except Exception as exc:  # a bug: named, counted and raised as a failed request
            log.exception("pool %s: scale to %d engines failed", self.name, engines)
            self.errors.append(f"scale to {engines} engines failed: {reason(exc)}"[:300])
            raise ScaleError(f"pool {self.name!r}: scale to {engines} engines failed: {reason(exc)}",
                             "failed") from exc
        finally:
            self.metrics.scale_events.labels(direction=direction, outcome=outcome).inc()

    async def _scale(self, engines: int, admit: Admit, drain: Drain, drain_timeout_s: float | None
                     ) -> ScaleResult:
        t0, before = time.perf_counter(), len(self.handles)
        recipe = self.scaled_recipe(engines)
        added, removed, handed_back = [], [], 0
        if engines > before:
            added = await self._add(recipe, admit)
        elif engines < before:
            removed = sorted(self.handles, key=engine_index)[engines:]
            timeout_s = min(MAX_DRAIN_TIMEOUT_S, self.recipe.policy.generation.request_timeout_s
                            if drain_timeout_s is None else drain_timeout_s)
            handed_back = await drain(removed, timeout_s)
            await self._remove(removed)
        self.recipe = recipe
        log.info("pool %s: scaled from %d to %d engines (added %s, removed %s, %d prompts handed back)",
                 self.name, before, len(self.handles), added, removed, handed_back)
        return ScaleResult(before, len(self.handles), added, removed, handed_back, time.perf_counter() - t0,
                           {e: self.table.state(e, self.version) for e in self.table})

    def scaled_recipe(self, engines: int) -> Recipe:
        """The pool's recipe with ``rollout_pool.num_engines = engines``, validated as at deploy (bounds,
        GPU layout); a colocated pool on GPUs is refused."""
        if colocated_on_gpus(self.recipe):
            raise ScaleError(f"pool {self.name!r} is colocated on GPUs (policy.generation.colocated.enabled): "
                             f"engine i and learner rank i share GPU slot i of its colocation placement group, "
                             f"fixed at deploy, so its engines cannot be added or removed; deploy it again with "
                             f"rollout_pool.num_engines={engines}", "refused")
        data = self.recipe.model_dump(mode="json")
        data["rollout_pool"]["num_engines"] = engines
        try:
            return type(self.recipe).model_validate(data)
        except ValidationError as err:
            why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'recipe'}: {e['msg']}" for e in err.errors())
            raise ScaleRequestError(f"pool {self.name!r} cannot have {engines} engines: {why}") from None

    async def _add(self, recipe: Recipe, admit: Admit) -> list[str]:
        """Create and boot the engines ``recipe`` has and the pool lacks (placement checked as at deploy), then
        admit each; on any failure the engines being added are removed."""
        made: dict[str, EngineHandle] = {}  # the existing engines too: their actors are found by name
        started: dict[str, EngineStarted] = {}
        try:
            await asyncio.to_thread(create_engines, recipe, self.name, self.model_path, self.colocation, made,
                                    self.access)
            for eid in made:
                if eid not in self.handles:
                    self.table.mark_starting(eid)
            await boot_engines({e: h for e, h in made.items() if e not in self.handles}, BOOT_TIMEOUT_S, started,
                               recipe)
        except Exception as exc:  # noqa: BLE001 - what was made is removed, the reason raised
            fresh = {e: h for e, h in made.items() if e not in self.handles}
            for eid in fresh:
                self.table.forget(eid)
            problems = await discard_engines(fresh, set(started), None)  # (empties ``fresh``)
            if isinstance(exc, PlacementError):
                raise ScaleError(f"pool {self.name!r}: the new engines do not fit: {exc}", "refused") from None
            left = f"; not removed: {problems}" if problems else ""
            raise ScaleError(f"pool {self.name!r}: adding engines failed: {reason(exc)} (the engines being added "
                             f"were removed{left})", "failed") from None
        fresh = sorted((e for e in made if e not in self.handles), key=engine_index)
        for eid in fresh:
            self.handles[eid] = made[eid]
            await admit(eid)  # the pool's version installed (or the learner's next push brings it), then up
        return fresh

    async def _remove(self, eids: list[str]) -> None:
        """Forget ``eids`` (under the refit lock: no push is installing on them), then stop their actors."""
        import ray

        async with self.refit_lock:
            gone = {e: self.handles.pop(e) for e in eids}
            for eid in eids:
                self.table.forget(eid)
                try:
                    self.metrics.engine_up.remove(eid)
                except KeyError:
                    pass  # never marked up
        problems = await discard_engines(gone, set(gone), None)
        self.errors.extend(f"scale-down: {p}"[:300] for p in problems)
        deadline = time.monotonic() + NAME_FREED_TIMEOUT_S
        for eid in eids:
            while time.monotonic() < deadline:
                try:
                    await asyncio.to_thread(ray.get_actor, eid, ENGINE_NAMESPACE)
                except ValueError:
                    break  # the name is free
                await asyncio.sleep(0.2)

    async def shutdown(self) -> None:
        import ray

        engines = list(self.handles.values())  # all at once: each vLLM engine takes seconds to stop
        await asyncio.gather(*(asyncio.wait_for(eng.shutdown.remote(), 60) for eng in engines),
                             return_exceptions=True)  # an engine that fails to stop is killed below anyway
        for eng in engines:
            ray.kill(eng, no_restart=True)
        self.handles.clear()
        if self.colocation is not None:
            ray.util.remove_placement_group(self.colocation)
            self.colocation = None


def engine_index(eid: str) -> int:
    """``3`` of ``<pool>-engine-3`` (:func:`services.pool.startup.engine_name`)."""
    return int(eid.rsplit("-", 1)[1])
