"""A vLLM engine core that dies inside a live engine actor: the actor's health says so, ``start`` restarts vLLM in
place, ``generate`` hands the pending prompts back (never reported failed), and the pool marks the engine down,
re-queues them and re-syncs the restarted engine (weights reinstalled, weight group stale). Small fakes stand in
for vLLM and Ray; the integration test is ``test_faults.py::test_a_vllm_engine_core_killed_inside_a_live_engine_...``."""
from __future__ import annotations

import asyncio
import types
from dataclasses import replace

import numpy as np
import pytest

import rollout.engine
from protocol import ControlMessage, PromptRequest, TrajectoryGroup, decode, encode
from rollout.config import GenerationConfig
from rollout.counters import RolloutCounters
from rollout.install.installer import InstallStats
from rollout.kv_stats import KvCounters
from rollout.liveness import EngineDead
from rollout.sampling import SamplingStats
from handle_fakes import ActorMethod
from pool_fakes import FakeEngine, pool_of
from services.pool.dispatch import Batch
from services.pool.engine_actor import EngineActor, EngineSpec
from services.pool.engine_replies import BatchReport
from services.refit.port import KeptPush


class FakeRolloutEngine:
    """A RolloutEngine whose vLLM core can be killed: then generation raises EngineDead, as the real one does."""

    built: list["FakeRolloutEngine"] = []

    def __init__(self, *args, **kwargs):
        self.dead, self.started, self.shut_down, self.refits, self.version = "", False, False, 0, 0
        FakeRolloutEngine.built.append(self)

    async def start(self):
        self.started = True

    async def shutdown(self):
        self.shut_down = True

    def dead_reason(self) -> str:
        return self.dead

    def counters(self) -> RolloutCounters:
        return RolloutCounters("e0", self.version, SamplingStats(), InstallStats(refits=self.refits), KvCounters(),
                               sleeps_skipped_on_cpu=0, weights_broken="", vllm_unfinished_requests=0)

    async def generate(self, requests, group_size):
        yield _group(requests[0])  # the first prompt is delivered, then the core dies
        self.dead = "vLLM engine core died (engine_dead)"
        raise EngineDead(f"rollout engine e0: {self.dead}")


def _group(req: PromptRequest) -> TrajectoryGroup:
    from protocol import Trajectory

    trajs = [Trajectory([1, 2], [-0.1, -0.2], [0, 0], 1.0), Trajectory([1, 3], [-0.1, -0.3], [0, 0], 0.0)]
    return TrajectoryGroup(f"g-{req.prompt_id}", req.prompt_id, req.prompt_ids, trajs, 2, 16,
                           scheduled_step=req.scheduled_step)


class FakeChannel:
    name = "ch"

    def __init__(self):
        self.sent: list = []

    async def send_async(self, data: bytes, timeout_s: float) -> None:
        self.sent.append(decode(data))


@pytest.fixture
def actor(monkeypatch, tmp_path):
    FakeRolloutEngine.built.clear()
    monkeypatch.setattr(rollout.engine, "RolloutEngine", FakeRolloutEngine)
    (tmp_path / "config.json").write_text("{}")  # a model directory on this node: nothing to ship
    return EngineActor(EngineSpec("e0", str(tmp_path), GenerationConfig(), 256, "repeat_letter", 5.0, False, True,
                                  channel_timeout_s=1.0))


def test_health_asks_vllm_and_start_restarts_a_dead_engine_in_place(actor):
    async def scenario():
        assert (await actor.health()).ok is False                      # not started yet
        first = await actor.start()
        h = await actor.health()
        assert h.ok and not h.error and h.incarnation == first.incarnation
        actor.engine.refits, actor.engine.version = 3, 7
        assert (await actor.start()) == replace(first, version=7)       # alive: start does nothing
        assert len(FakeRolloutEngine.built) == 1
        dead = actor.engine
        dead.dead = "vLLM engine core died (engine_dead)"
        h = await actor.health()
        assert h.ok is False and "engine core died" in h.error          # the actor lives; vLLM does not
        again = await actor.start()
        assert dead.shut_down and actor.engine is not dead and actor.engine.started
        assert again.pid == first.pid and again.incarnation != first.incarnation
        h = await actor.health()
        assert h.ok and h.version == 0 and not h.synced                # the model on disk, no push yet

    asyncio.run(scenario())


def test_generate_on_a_dying_engine_hands_pending_prompts_back_and_reports_none_failed(actor):
    async def scenario():
        await actor.start()
        reqs = [PromptRequest(f"p{i}", np.array([1, 2, 3], np.int32), scheduled_step=1) for i in range(3)]
        channel = FakeChannel()
        out = await actor.generate([encode(r) for r in reqs], 2, channel)
        assert [type(m) for m in channel.sent] == [TrajectoryGroup]     # no ControlMessage("error") at all
        assert out.requeue == [1, 2] and "engine core died" in out.engine_dead and out.undelivered == []
        assert not any(isinstance(m, ControlMessage) for m in channel.sent)

    asyncio.run(scenario())


def test_the_pool_requeues_a_dead_cores_pending_prompts_and_marks_the_engine_down():
    async def scenario():
        async def generate(prompts, group_size, channel):
            return BatchReport(3, [], engine_dead="vLLM engine core died", requeue=[1, 2])

        engine = types.SimpleNamespace(generate=ActorMethod(generate))
        d = pool_of({"e0": engine}).dispatcher
        d.attach("L", FakeChannel())

        await d.track("e0", Batch([b"a", b"b", b"c"], 2, d.channel))
        state = d.fleet.table["e0"]
        assert state.up is False and state.error is not None and "engine core died" in state.error
        assert [b.prompts for b in d.waiting] == [[b"b", b"c"]] and d.requeued_prompts == 2
        assert d.undelivered == []                                       # nothing reported failed

    asyncio.run(scenario())


def test_a_restarted_vllm_gets_the_latest_weights_even_at_the_same_version_and_leaves_the_weight_group():
    """The pool is at version 0 with kept weights (e.g. a learner's reset push of v0); the engine's vLLM died and
    restarts at version 0 from disk: the versions match, yet the weights must be installed again, and the weight
    group (keyed by incarnation) no longer holds this engine, though its pid is the same."""
    async def scenario():
        engine = FakeEngine(ok=True)
        engine.release.set()
        p = pool_of({"e0": engine})
        p.fleet.kept = KeptPush(b"manifest", [])
        applied = []

        async def install(eid, manifest, refs, reset, timeout_s=None):
            applied.append((eid, reset))
        p.fanout._install = install
        synced = {"value": True}
        health = engine._health

        async def health_with_sync():
            return replace(await health(), synced=synced["value"], error="" if engine.ok else "core died")
        engine.health = ActorMethod(health_with_sync)

        await p.watcher.check_engine("e0")
        assert applied == [] and p.fleet.table["e0"].up                 # in sync: nothing to do
        p.group.members = p.fleet.table.incarnations_up()
        assert p.group.current()
        engine.ok, synced["value"] = False, False                        # the core died; same pid
        await p.watcher.check_engine("e0")
        assert engine.starts == 1 and applied == [("e0", True)]
        state = p.fleet.table["e0"]
        assert state.up and state.pid == 1 and state.version == 0
        assert not p.group.current()                                     # a new incarnation: re-form the group

    asyncio.run(scenario())
