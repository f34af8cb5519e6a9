"""The pool's health watcher: one engine restarting does not hold up the checks of the others; an engine that
answers its health check late is not marked down at once."""
from __future__ import annotations

import asyncio

import pytest

from services import pool as pool_module
from services.metrics import PoolMetrics


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class FakeEngine:
    """``health``/``start``/``stats`` like an EngineActor handle; ``start`` can be held open."""

    def __init__(self, ok: bool):
        self.ok, self.health_calls, self.starts, self.slow, self.version = ok, 0, 0, False, 0
        self.release = asyncio.Event()
        self.health = _Method(self._health)
        self.start = _Method(self._start)
        self.stats = _Method(self._stats)

    async def _health(self):
        self.health_calls += 1
        if self.slow:
            await asyncio.sleep(3600)
        return {"ok": self.ok, "version": self.version, "pid": 1, "incarnation": f"1.{self.starts}"}

    async def _start(self):
        self.starts += 1
        await self.release.wait()  # vLLM takes tens of seconds to start
        self.ok = True

    async def _stats(self):
        return {"pid": 1, "tokens_generated": 0, "groups": 0}


def _pool(engines: dict) -> object:
    pool = object.__new__(pool_module.RolloutPool.func_or_class)
    pool.name, pool.engines, pool.version, pool._latest_weights = "p", engines, 0, None
    pool.engine_state = {e: {"up": True} for e in engines}
    pool.metrics, pool._counted, pool._waiting, pool._late_checks = PoolMetrics(), {}, [], {}
    pool._ready = asyncio.Event()
    pool._ready.set()
    pool.channel = None
    return pool


def _fast_checks(monkeypatch, period_s: float = 0.01, timeout_s: float = 10.0) -> None:
    # Serve's decorator copies the class: its methods read a copy of the module's globals
    module_globals = pool_module.RolloutPool.func_or_class._watch_engines.__globals__
    monkeypatch.setitem(module_globals, "HEALTH_PERIOD_S", period_s)
    monkeypatch.setitem(module_globals, "HEALTH_TIMEOUT_S", timeout_s)


def test_a_restarting_engine_does_not_hold_up_the_checks_of_the_others(monkeypatch):
    _fast_checks(monkeypatch)

    async def scenario():
        down, healthy = FakeEngine(ok=False), FakeEngine(ok=True)
        pool = _pool({"e0": down, "e1": healthy})
        watcher = asyncio.get_running_loop().create_task(pool._watch_engines())
        await asyncio.sleep(0.3)
        assert down.starts == 1                      # one restart in flight, not one per period
        assert healthy.health_calls >= 5             # checked every period meanwhile
        down.release.set()
        await asyncio.sleep(0.1)
        assert pool.engine_state["e0"]["up"] is True and down.health_calls >= 2
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher

    asyncio.run(scenario())


def test_an_engine_answering_late_is_marked_down_only_after_three_late_checks_in_a_row(monkeypatch):
    _fast_checks(monkeypatch, timeout_s=0.05)

    async def scenario():
        engine = FakeEngine(ok=True)
        pool = _pool({"e0": engine})
        engine.slow = True
        for _ in range(pool_module.HEALTH_TIMEOUTS_TO_DOWN - 1):
            await pool._check_engine("e0")
        assert pool.engine_state["e0"]["up"] is True          # busy, not dead
        engine.slow = False
        await pool._check_engine("e0")                           # answers again: the count starts over
        engine.slow = True
        for _ in range(pool_module.HEALTH_TIMEOUTS_TO_DOWN - 1):
            await pool._check_engine("e0")
        assert pool.engine_state["e0"]["up"] is True
        await pool._check_engine("e0")
        assert pool.engine_state["e0"]["up"] is False and "TimeoutError" in pool.engine_state["e0"]["error"]

    asyncio.run(scenario())


def test_an_engine_whose_vllm_is_not_running_is_down_while_it_restarts(monkeypatch):
    _fast_checks(monkeypatch)

    async def scenario():
        engine = FakeEngine(ok=False)
        pool = _pool({"e0": engine})
        check = asyncio.get_running_loop().create_task(pool._check_engine("e0"))
        await asyncio.sleep(0.05)
        assert engine.starts == 1 and pool.engine_state["e0"]["up"] is False   # no work while vLLM starts
        engine.release.set()
        await check
        assert pool.engine_state["e0"]["up"] is True

    asyncio.run(scenario())


def test_a_collective_push_landing_while_the_watcher_waits_for_the_refit_lock_leaves_the_engine_up(monkeypatch):
    """The watcher saw an engine behind the pool's version with object-store weights kept; by the time it held
    the refit lock a collective push had installed a newer version and cleared them."""
    _fast_checks(monkeypatch)

    async def scenario():
        engine = FakeEngine(ok=True)
        pool = _pool({"e0": engine})
        pool.version, pool._latest_weights = 3, (b"manifest", [])
        pool._refit_lock = asyncio.Lock()
        applied = []

        async def apply_to(eid, manifest, refs, reset):
            applied.append(eid)
        pool._apply_to = apply_to
        await pool._refit_lock.acquire()                      # a collective push is in progress
        check = asyncio.get_running_loop().create_task(pool._check_engine("e0"))
        await asyncio.sleep(0.05)
        pool.version, pool._latest_weights = 4, None           # ... and lands
        engine.version = 4
        pool._refit_lock.release()
        await check
        assert applied == []                                   # nothing stale installed
        assert pool.engine_state["e0"] == {"up": True, "version": 4, "error": None, "pid": 1, "incarnation": "1.0"}

    asyncio.run(scenario())


def test_the_learner_is_detached_after_three_late_channel_checks_in_a_row_or_at_once_when_its_actor_died(
        monkeypatch):
    import types

    import ray

    _fast_checks(monkeypatch, timeout_s=0.05)
    behaviour = {"mode": "late"}

    async def size():
        if behaviour["mode"] == "late":
            await asyncio.sleep(3600)
        if behaviour["mode"] == "dead":
            raise ray.exceptions.RayActorError()
        return 0

    def attach(pool):
        pool.learner, pool._undelivered = {"id": "L"}, []
        pool.channel = types.SimpleNamespace(actor=types.SimpleNamespace(size=_Method(size)))

    async def scenario():
        pool = _pool({})
        attach(pool)
        for _ in range(pool_module.HEALTH_TIMEOUTS_TO_DOWN - 1):
            await pool._check_learner()
        assert pool.channel is not None                          # busy, not gone
        behaviour["mode"] = "ok"
        await pool._check_learner()                              # answers again: the count starts over
        behaviour["mode"] = "late"
        for _ in range(pool_module.HEALTH_TIMEOUTS_TO_DOWN - 1):
            await pool._check_learner()
        assert pool.channel is not None
        await pool._check_learner()
        assert pool.channel is None and pool.learner is None
        attach(pool)
        behaviour["mode"] = "dead"
        await pool._check_learner()
        assert pool.channel is None                              # a dead actor is gone at once

    asyncio.run(scenario())


class FakeInstaller:
    """``apply_weights`` like an EngineActor handle: installs a version once, rejects it as not newer after that
    (like rollout.weight_receiver), and fails its first ``fail_first`` calls."""

    def __init__(self, fail_first: int = 0):
        self.version, self.calls, self.fail_first = 0, 0, fail_first
        self.apply_weights = _Method(self._apply)

    async def _apply(self, manifest_bytes, refs, reset):
        from protocol import WeightManifest, decode
        from rollout.weight_receiver import WeightUpdateError

        self.calls += 1
        v = decode(manifest_bytes, expect=WeightManifest).version
        if self.calls <= self.fail_first:
            raise WeightUpdateError(f"weight push v{v} rejected: bucket 0 checksum mismatch")
        if v <= self.version and not reset:
            raise WeightUpdateError(f"weight push rejected: manifest.version {v} must be greater than the version "
                                    f"being served ({self.version})")
        self.version = v
        return v


def test_a_push_retried_after_failing_on_one_engine_is_not_rejected_by_the_engines_that_installed_it(monkeypatch):
    """A push that one engine rejected is retried by the learner; the engines that installed it the first time
    keep it instead of rejecting the retry as not newer (the retry used to fail on every attempt)."""
    import numpy as np
    import ray

    from protocol import encode
    from protocol.weights import pack_buckets
    from services.config import load_recipe

    monkeypatch.setattr(ray, "put", lambda data: data)
    manifest, buckets = pack_buckets([("w", "float32", (2,), np.zeros(8, np.uint8))], version=1,
                                    bucket_bytes=1024)

    async def scenario():
        good, flaky = FakeInstaller(), FakeInstaller(fail_first=1)
        pool = _pool({"e0": good, "e1": flaky})
        pool.recipe, pool._refit_lock, pool._errors = load_recipe(None, []), asyncio.Lock(), []
        for s in pool.engine_state.values():
            s["version"] = 0

        def refs():
            async def bucket(b):
                return encode(b)
            return [bucket(b) for b in buckets]

        with pytest.raises(pool_module.RefitError, match="rejected"):
            await pool.update_weights(encode(manifest), refs())
        assert pool.version == 0 and good.version == 1 and flaky.version == 0
        out = await pool.update_weights(encode(manifest), refs())
        assert out["version"] == pool.version == 1 and flaky.version == 1
        assert good.calls == 1                       # kept what it had installed; not asked again

    asyncio.run(scenario())
