"""The pool's health watcher: one engine restarting does not hold up the checks of the others; an engine that
answers its health check late is not marked down at once; a learner whose channel is gone is detached."""
from __future__ import annotations

import asyncio
import types

import pytest
from handle_fakes import ActorMethod
from pool_fakes import FakeEngine, pool_of

from services.pool.engine_table import EngineState
from services.pool.watcher import HEALTH_TIMEOUTS_TO_DOWN
from services.refit.port import KeptPush


def test_a_restarting_engine_does_not_hold_up_the_checks_of_the_others():
    async def scenario():
        down, healthy = FakeEngine(ok=False), FakeEngine(ok=True)
        p = pool_of({"e0": down, "e1": healthy})
        watcher = asyncio.get_running_loop().create_task(p.watcher.watch())
        await asyncio.sleep(0.3)
        assert down.starts == 1                      # one restart in flight, not one per period
        assert healthy.health_calls >= 5             # checked every period meanwhile
        down.release.set()
        await asyncio.sleep(0.1)
        assert p.fleet.table["e0"].up is True and down.health_calls >= 2
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher

    asyncio.run(scenario())


def test_an_engine_answering_late_is_marked_down_only_after_three_late_checks_in_a_row():
    async def scenario():
        engine = FakeEngine(ok=True)
        p = pool_of({"e0": engine}, timeout_s=0.05)
        engine.slow = True
        for _ in range(HEALTH_TIMEOUTS_TO_DOWN - 1):
            await p.watcher.check_engine("e0")
        assert p.fleet.table["e0"].up is True          # busy, not dead
        engine.slow = False
        await p.watcher.check_engine("e0")                # answers again: the count starts over
        engine.slow = True
        for _ in range(HEALTH_TIMEOUTS_TO_DOWN - 1):
            await p.watcher.check_engine("e0")
        assert p.fleet.table["e0"].up is True
        await p.watcher.check_engine("e0")
        state = p.fleet.table["e0"]
        assert state.up is False and state.error is not None and "TimeoutError" in state.error

    asyncio.run(scenario())


def test_an_engine_whose_vllm_is_not_running_is_down_while_it_restarts():
    async def scenario():
        engine = FakeEngine(ok=False)
        p = pool_of({"e0": engine})
        check = asyncio.get_running_loop().create_task(p.watcher.check_engine("e0"))
        await asyncio.sleep(0.05)
        assert engine.starts == 1 and p.fleet.table["e0"].up is False   # no work while vLLM starts
        assert p.fleet.serving() == []
        engine.release.set()
        await check
        assert p.fleet.table["e0"].up is True and p.fleet.serving() == ["e0"]

    asyncio.run(scenario())


def test_a_collective_push_landing_while_the_watcher_waits_for_the_refit_lock_leaves_the_engine_up():
    """The watcher saw an engine behind the pool's version with object-store weights kept; by the time it held
    the refit lock a collective push had installed a newer version and cleared them."""
    async def scenario():
        engine = FakeEngine(ok=True)
        p = pool_of({"e0": engine})
        p.fleet.version, p.fleet.kept = 3, KeptPush(b"manifest", [])
        installed = []

        async def install(eid, manifest, refs, reset, timeout_s=None):
            installed.append(eid)
        p.fanout._install = install
        await p.fleet.refit_lock.acquire()                      # a collective push is in progress
        check = asyncio.get_running_loop().create_task(p.watcher.check_engine("e0"))
        await asyncio.sleep(0.05)
        p.fleet.version, p.fleet.kept = 4, None                  # ... and lands
        engine.version = 4
        p.fleet.refit_lock.release()
        await check
        assert installed == []                                   # nothing stale installed
        assert p.fleet.table["e0"] == EngineState(up=True, version=4, pid=1, incarnation="1.0", error=None)

    asyncio.run(scenario())


def test_the_learner_is_detached_after_three_late_channel_checks_in_a_row_or_at_once_when_its_actor_died():
    import ray

    behaviour = {"mode": "late"}

    async def size():
        if behaviour["mode"] == "late":
            await asyncio.sleep(3600)
        if behaviour["mode"] == "dead":
            raise ray.exceptions.RayActorError()
        return 0

    channel = types.SimpleNamespace(name="ch", actor=types.SimpleNamespace(size=ActorMethod(size)))

    async def scenario():
        p = pool_of({}, timeout_s=0.05)
        p.dispatcher.attach("L", channel)
        for _ in range(HEALTH_TIMEOUTS_TO_DOWN - 1):
            await p.watcher.check_learner()
        assert p.dispatcher.channel is not None                  # busy, not gone
        behaviour["mode"] = "ok"
        await p.watcher.check_learner()                          # answers again: the count starts over
        behaviour["mode"] = "late"
        for _ in range(HEALTH_TIMEOUTS_TO_DOWN - 1):
            await p.watcher.check_learner()
        assert p.dispatcher.channel is not None
        await p.watcher.check_learner()
        assert p.dispatcher.channel is None and p.dispatcher.learner is None
        p.dispatcher.attach("L", channel)
        behaviour["mode"] = "dead"
        await p.watcher.check_learner()
        assert p.dispatcher.channel is None                      # a dead actor is gone at once

    asyncio.run(scenario())
