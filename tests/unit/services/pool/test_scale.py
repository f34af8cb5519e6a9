"""Scaling the pool (``Fleet.scale`` with the dispatcher's drain and the watcher's admission), on fake engines.

A new engine is booted, then admitted: it takes no work until it holds the pool's version (the kept push
installed, or the learner's next push after a collective one); a removed engine gets no new work, its
batches finish within the drain bound or are handed back to the others once (never twice); bad requests
are refused with the field and value, and every request is counted by direction and outcome.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import ray
from handle_fakes import ActorMethod
from pool_fakes import engine_stats, pool_of

from services.recipe.config import load_recipe
from services.pool import fleet as fleet_module
from services.pool.engine_replies import BatchReport, EngineHealth, EngineStarted
from services.pool.fleet import ScaleError, ScaleRequestError
from services.pool.startup import engine_name
from services.refit.port import KeptPush

POOL = "inflight-pool"  # the default recipe's rollout_pool.name


def eid(i: int) -> str:
    return engine_name(POOL, i)


class Engine:
    """An engine actor handle: boots serving the model on disk (version 0), installs pushes (``install_gate``
    holds an install open), generates batches (``hold`` keeps them running)."""

    def __init__(self, boots: bool = True):
        self.version, self.boots, self.stopped = 0, boots, False
        self.batches: list[list[bytes]] = []
        self.hold, self.install_gate = asyncio.Event(), asyncio.Event()
        self.hold.set()
        self.install_gate.set()
        for name in ("health", "start", "stats", "install", "generate"):
            setattr(self, name, ActorMethod(getattr(self, f"_{name}")))

    async def _health(self):
        return EngineHealth("fake", ok=True, error="", version=self.version, synced=self.version > 0,
                            running_batches=0, pid=1, incarnation="1.1")

    async def _start(self):
        if not self.boots:
            raise RuntimeError("vLLM engine died while loading the model")
        return EngineStarted("fake", self.version, pid=1, incarnation="1.1")

    async def _stats(self):
        return engine_stats(incarnation="1.1")

    async def _install(self, manifest_bytes, refs, reset):
        await self.install_gate.wait()
        self.version = int(manifest_bytes.decode())
        return self.version

    async def _generate(self, prompts, group_size, channel):
        self.batches.append(prompts)
        await self.hold.wait()
        return BatchReport(len(prompts), [])


@pytest.fixture
def cluster(monkeypatch):
    """Engine actors by name, created by a fake ``create_engines`` (the existing ones found by name, as with
    ``get_if_exists``) and removed by a fake ``discard_engines``; ``ray.get_actor`` looks them up."""
    actors: dict[str, Engine] = {}
    new = SimpleNamespace(boots=True, install_gate=None)
    """How the next engines made boot, and the event their installs wait for (None: they do not wait)."""

    def create_engines(recipe, pool_name, model_path, group, into, access=None):
        for i in range(recipe.rollout_pool.num_engines):
            name = engine_name(pool_name, i)
            if name not in actors:
                actors[name] = Engine(boots=new.boots)
                actors[name].install_gate = new.install_gate or actors[name].install_gate
            into[name] = actors[name]

    async def discard_engines(engines, started, group):
        for name in list(engines):
            actors.pop(name).stopped = True
        engines.clear()
        return []

    def get_actor(name, namespace=None):
        if name not in actors:
            raise ValueError(f"no actor {name}")
        return actors[name]

    monkeypatch.setattr(fleet_module, "create_engines", create_engines)
    monkeypatch.setattr(fleet_module, "discard_engines", discard_engines)
    monkeypatch.setattr(ray, "get_actor", get_actor)
    return SimpleNamespace(actors=actors, new=new)


def pool_at_version(cluster, version: int, engines: int = 1):
    """A booted pool of ``engines`` fake engines at ``version``, the object-store push of it kept, a learner
    attached."""
    for i in range(engines):
        cluster.actors[eid(i)] = Engine()
        cluster.actors[eid(i)].version = version
    p = pool_of({eid(i): cluster.actors[eid(i)] for i in range(engines)})
    p.fleet.version, p.fleet.kept = version, KeptPush(str(version).encode(), [])
    for i in range(engines):
        p.fleet.table.set_version(eid(i), version)
    p.dispatcher.attach("L", SimpleNamespace(name="L-trajectories"))
    return p


def scale(p, engines: int, drain_timeout_s: float | None = None):
    return p.fleet.scale(engines, p.watcher.admit, p.dispatcher.drain, drain_timeout_s)


def events(p) -> dict[tuple[str, str], float]:
    return {(s.labels["direction"], s.labels["outcome"]): s.value
            for m in p.fleet.metrics.scale_events.collect() for s in m.samples if s.name.endswith("_total")}


def engines_gauge(p) -> dict[str, float]:
    return {s.labels["state"]: s.value for m in p.fleet.metrics.engines.collect() for s in m.samples}


def test_a_new_engine_takes_no_work_until_it_holds_the_pools_version(cluster):
    async def scenario():
        p = pool_at_version(cluster, 3)
        old = cluster.actors[eid(0)]
        gate = cluster.new.install_gate = asyncio.Event()              # the new engine's install of v3 waits
        scaling = asyncio.ensure_future(scale(p, 2))
        while eid(1) not in p.fleet.handles:
            await asyncio.sleep(0.01)
        assert p.fleet.table.state(eid(1), 3) == "starting"            # booted, installing v3
        assert engines_gauge(p) == {"starting": 1, "up": 1, "stale": 0, "draining": 0, "down": 0}
        p.dispatcher.submit([b"a", b"b", b"c"], 2)
        await asyncio.sleep(0.05)
        assert old.batches == [[b"a", b"b", b"c"]]                    # all to the engine at v3
        gate.set()
        result = await scaling
        new = cluster.actors[eid(1)]
        assert new.version == 3 and p.fleet.table.state(eid(1), 3) == "up"
        assert result.added == [eid(1)] and result.engines == 2 and result.states == {eid(0): "up", eid(1): "up"}
        p.dispatcher.submit([b"d", b"e"], 2)
        await asyncio.gather(*p.dispatcher.batches)
        assert [b"e"] in new.batches or [b"d"] in new.batches              # now it takes its share
        assert events(p) == {("up", "done"): 1}
        assert p.fleet.recipe.rollout_pool.num_engines == 2

    asyncio.run(scenario())


def test_after_a_collective_push_a_new_engine_stays_stale_until_the_learners_next_push(cluster):
    async def scenario():
        p = pool_at_version(cluster, 5)
        p.fleet.kept = None                                            # the pool keeps no weights
        result = await scale(p, 2)
        assert result.states[eid(1)] == "stale" and p.fleet.serving() == [eid(0)]
        assert p.group.wanting_weights() == [eid(1)]                   # the learner's cue to bring it in
        assert not p.group.current()                                   # ... by forming the group again
        p.fleet.table.set_version(eid(1), 5)                           # its install of the next push
        assert p.fleet.serving() == [eid(0), eid(1)]

    asyncio.run(scenario())


def test_an_engine_that_does_not_boot_fails_the_scale_and_is_removed(cluster):
    async def scenario():
        p = pool_at_version(cluster, 1)
        cluster.new.boots = False
        with pytest.raises(ScaleError, match="adding engines failed: .*RuntimeError: vLLM engine died") as err:
            await scale(p, 3)
        assert err.value.outcome == "failed"
        assert list(p.fleet.handles) == [eid(0)] and list(p.fleet.table) == [eid(0)]
        assert sorted(cluster.actors) == [eid(0)]                      # both new actors were removed
        assert events(p) == {("up", "failed"): 1} and "scale to 3 engines failed" in p.fleet.errors[-1]

    asyncio.run(scenario())


def test_bad_or_untimely_requests_are_refused_with_the_reason_and_counted(cluster, monkeypatch):
    async def scenario():
        p = pool_at_version(cluster, 0)
        with pytest.raises(ScaleRequestError, match="rollout_pool.num_engines: Input should be greater than or "
                                                    "equal to 1"):
            await scale(p, 0)
        with pytest.raises(ScaleRequestError, match="cannot have 5000 engines: rollout_pool.num_engines: Input "
                                                    "should be less than or equal to 1024"):
            await scale(p, 5000)
        new_install = cluster.new.install_gate = asyncio.Event()       # hold the next scale-up's install
        first = asyncio.ensure_future(scale(p, 2))
        while eid(1) not in p.fleet.handles:
            await asyncio.sleep(0.01)
        with pytest.raises(ScaleError, match="another scale request is in progress") as err:
            await scale(p, 1)
        assert err.value.outcome == "refused"
        new_install.set()
        await first
        assert len(p.fleet.handles) == 2 and (await scale(p, 2)).added == []
        assert events(p) == {("down", "refused"): 2, ("up", "refused"): 1, ("up", "done"): 1, ("none", "done"): 1}
        assert p.fleet.errors == []                                    # refusals are the caller's, not errors

        p.fleet.ready.clear()
        with pytest.raises(ScaleError, match="not serving yet"):
            await scale(p, 3)

    asyncio.run(scenario())


def test_a_colocated_gpu_pool_refuses_to_scale_and_says_why(cluster):
    async def scenario():
        p = pool_at_version(cluster, 0)
        p.fleet.recipe = load_recipe(None, ["cluster.gpus_per_node=1", "policy.generation.colocated.enabled=true",
                                            "grpo.async_grpo.enabled=false"])
        with pytest.raises(ScaleError, match="colocated on GPUs .* share GPU slot i .* deploy it again with "
                                             "rollout_pool.num_engines=2"):
            await scale(p, 2)
        assert list(p.fleet.handles) == [eid(0)]

    asyncio.run(scenario())


def test_a_removed_engine_finishes_its_batches_within_the_bound_and_gets_no_new_work(cluster):
    async def scenario():
        p = pool_at_version(cluster, 2, engines=2)
        busy = cluster.actors[eid(1)]
        busy.hold.clear()
        p.dispatcher.submit([b"a", b"b"], 2)                            # b -> engine 1, held
        await asyncio.sleep(0.01)
        scaling = asyncio.ensure_future(scale(p, 1, drain_timeout_s=30))
        await asyncio.sleep(0.05)
        assert p.fleet.table.state(eid(1), 2) == "draining" and not scaling.done()
        p.dispatcher.submit([b"c", b"d"], 2)
        await asyncio.sleep(0.01)
        assert busy.batches == [[b"b"]]                                # no new work while draining
        busy.hold.set()                                                # its batch finishes
        result = await scaling
        assert result.removed == [eid(1)] and result.handed_back_prompts == 0 and result.engines == 1
        assert busy.stopped and list(p.fleet.handles) == [eid(0)] and list(p.fleet.table) == [eid(0)]
        assert p.dispatcher.requeued_prompts == 0 and p.fleet.recipe.rollout_pool.num_engines == 1

    asyncio.run(scenario())


def test_a_removed_engines_batch_still_running_at_the_bound_is_handed_back_once(cluster):
    async def scenario():
        p = pool_at_version(cluster, 2, engines=2)
        keep, gone = cluster.actors[eid(0)], cluster.actors[eid(1)]
        gone.hold.clear()                                              # never finishes
        p.dispatcher.submit([b"a", b"b", b"c", b"d"], 2)               # b, d -> engine 1
        await asyncio.sleep(0.01)
        result = await scale(p, 1, drain_timeout_s=0.05)
        await asyncio.gather(*p.dispatcher.batches)
        assert result.handed_back_prompts == 2 and p.dispatcher.requeued_prompts == 2
        assert keep.batches == [[b"a", b"c"], [b"b", b"d"]]            # handed back to the engine that stays
        assert gone.stopped and p.dispatcher.waiting_prompts() == 0
        p.fleet.mark_down(eid(1), RuntimeError("its actor died later"))  # a late death of a removed engine
        assert eid(1) not in p.fleet.table and p.dispatcher.requeued_prompts == 2
        assert events(p) == {("down", "done"): 1}
        assert engines_gauge(p) == {"starting": 0, "up": 1, "stale": 0, "draining": 0, "down": 0}

    asyncio.run(scenario())


def test_scale_down_then_up_reuses_the_freed_engine_number(cluster):
    async def scenario():
        p = pool_at_version(cluster, 4, engines=3)
        assert (await scale(p, 1)).removed == [eid(1), eid(2)]         # the highest numbers go
        assert (await scale(p, 2)).added == [eid(1)]
        assert cluster.actors[eid(1)].version == 4 and p.fleet.serving() == [eid(0), eid(1)]

    asyncio.run(scenario())


def test_a_restarted_replica_keeps_the_engines_a_scale_up_added(cluster):
    p = pool_at_version(cluster, 0)
    for i in (1, 2):
        cluster.actors[eid(i)] = Engine()
    p.fleet._adopt_scaled_engines()
    assert list(p.fleet.handles) == [eid(0), eid(1), eid(2)] and p.fleet.recipe.rollout_pool.num_engines == 3
