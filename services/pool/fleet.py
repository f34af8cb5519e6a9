"""The pool's engines and what every part of the pool shares about them.

A :class:`Fleet` holds the engine actors' handles, the :class:`EngineTable`, the
version the pool serves, the last object-store push it keeps for engines that
restart, the refit lock every install takes, and the errors ``status`` shows.
It boots the engines (:mod:`services.pool.startup`), shuts them down, and runs
the calls that go to every engine (sleep, wake, stats, log-probs). Dispatch,
the health watcher and the weight transports work on it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.pool.engine_table import EngineTable
from services.pool.metrics import PoolMetrics
from services.pool.placement import colocation_group
from services.pool.startup import BOOT_TIMEOUT_S, boot_engines, create_engines, discard_engines, reason
from services.refit.result import RefitError, describe, failure_reason

if TYPE_CHECKING:
    from services.config import Recipe

log = logging.getLogger("inflight.pool")
EngineHandle = Any
"""A Ray actor handle of :class:`services.pool.engine_actor.EngineActor`."""
CALL_TIMEOUT_S = 10.0
"""Longest a cheap engine call (health, stats, group size) may take."""


@dataclass(frozen=True)
class KeptPush:
    """The last object-store push: its manifest and the pool's own copy of its buckets."""

    manifest_bytes: bytes
    refs: list


class Fleet:
    def __init__(self, recipe: Recipe, model_path: Any, metrics: PoolMetrics):
        self.recipe, self.name, self.model_path, self.metrics = recipe, recipe.rollout_pool.name, model_path, metrics
        self.handles: dict[str, EngineHandle] = {}
        self.table = EngineTable()
        self.version = 0
        self.kept: KeptPush | None = None
        """Reinstalled on engines that restart; None after a collective push (the pool keeps no weights then)."""
        self.refit_lock = asyncio.Lock()
        self.errors: list[str] = []
        self.ready = asyncio.Event()
        self.colocation: Any = None
        self.started_at = time.time()

    async def start(self) -> None:
        """Place, create and boot the engines. Any error stops the start-up at once and removes what it made
        (engines, colocation group); the reason goes to ``errors`` and ``ready`` is set either way, so
        ``wait_ready`` answers at once and :func:`services.pool.deploy` fails with the reason."""
        started: dict[str, dict] = {}
        try:
            self.colocation = await asyncio.to_thread(colocation_group, self.recipe, self.name)
            create_engines(self.recipe, self.name, self.model_path, self.colocation, into=self.handles)
            await boot_engines(self.handles, BOOT_TIMEOUT_S, started, self.recipe)
            for eid in self.handles:
                res = started[eid]
                self.mark_up(eid, res["version"], res["pid"], res.get("incarnation"))
            self.metrics.policy_version.set(self.version)
        except Exception as exc:  # noqa: BLE001 - any start-up error fails the deploy, leaving nothing behind
            why = f"start-up failed: {reason(exc)}"[:500]
            log.error("pool %s: %s; removing its engines and placement group", self.name, why)
            self.errors.append(why)
            self.errors.extend(await discard_engines(self.handles, set(started), self.colocation))
            self.colocation = None
        finally:
            self.ready.set()

    def mark_up(self, eid: str, version: int, pid: int | None, incarnation: str | None) -> None:
        self.table.mark_up(eid, version, pid, incarnation)
        self.metrics.engine_up.labels(engine=eid).set(1)

    def mark_down(self, eid: str, exc: BaseException) -> None:
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
                          engine_id: str | None = None) -> list[list[float]]:
        eid = engine_id or (self.serving() or list(self.handles))[0]  # default: the first healthy engine
        return await asyncio.wait_for(self.handles[eid].logprobs_of.remote(prompt_ids, response_ids),
                                      self.recipe.policy.generation.request_timeout_s)

    async def sleep(self) -> None:
        await asyncio.gather(*[e.sleep.remote() for e in self.handles.values()])

    async def wake(self) -> None:
        await asyncio.gather(*[e.wake_up.remote() for e in self.handles.values()])

    async def engine_stats(self) -> dict[str, dict]:
        out = {}
        for eid, eng in self.handles.items():
            try:
                out[eid] = await asyncio.wait_for(eng.stats.remote(), CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001
                out[eid] = {"error": repr(exc)[:200]}
        return out

    async def shutdown(self) -> None:
        import ray

        for eng in self.handles.values():
            try:
                await asyncio.wait_for(eng.shutdown.remote(), 60)
            except Exception:  # noqa: BLE001 - killed below anyway
                pass
            ray.kill(eng, no_restart=True)
        self.handles.clear()
        if self.colocation is not None:
            ray.util.remove_placement_group(self.colocation)
            self.colocation = None
