"""An engine actor's typed stats (services/pool/engine_replies.EngineStats, rollout/counters.RolloutCounters) flatten
to the very dict the engines answered before they were typed: the same keys, in the same order, with the same
values (the counters of the pool's ``engine_stats`` answer, an ``EngineStatsReply``, read by key in the tests)."""
from __future__ import annotations

import asyncio
import dataclasses

import pool_fakes
from handle_fakes import ActorMethod

from protocol.pool_replies import EngineStatsReply
from rollout.counters import EnvCounters, RolloutCounters
from rollout.install.installer import InstallStats, PauseBreakdown
from rollout.kv_stats import KvCounters
from rollout.sampling import SamplingStats
from services.pool.engine_replies import ChatCounters, EngineStats

OUTCOMES = ("ok", "failed_step", "timeout", "http_5xx", "http_4xx", "malformed", "connection")


def _counters(env: EnvCounters | None) -> RolloutCounters:
    sampling = SamplingStats(groups=3, samples_ok=11, samples_failed=1, tokens_generated=420, requests_running=2,
                             episodes=12, turns=30, env_tokens=77, env_failures=1, episodes_truncated=2,
                             env_wait_seconds=1.5)
    installs = InstallStats(refits=2, refit_seconds_last=0.25, install_path_last="copy", refit_bytes_last=1 << 20,
                            drain_complete_last=False, phases_last=PauseBreakdown(verify_s=0.125, install_s=0.5))
    kv = KvCounters(kv_preemptions=4, vllm_generated_tokens=9)
    return RolloutCounters("pool-engine-0", 2, sampling, installs, kv, sleeps_skipped_on_cpu=1, weights_broken="",
                           vllm_unfinished_requests=5, env=env)


def _before(c: RolloutCounters, env: dict | None, chat: tuple[int, int] | None) -> dict:
    """The dict as ``RolloutEngine.stats()`` and ``EngineActor.stats()`` built it before (commit 9a1468b)."""
    out = {**vars(c.sampling), **c.installs.as_dict()}
    out.update(sleeps_skipped_on_cpu=c.sleeps_skipped_on_cpu, version=c.version, engine_id=c.engine_id,
               weights_broken=c.weights_broken, **c.kv.as_stats(), vllm_unfinished_requests=c.vllm_unfinished_requests)
    if c.env is not None:  # the rollout engine's environment
        s = c.sampling
        out["env"] = {"name": c.env.name, "episodes": s.episodes, "turns": s.turns, "env_tokens": s.env_tokens,
                      "env_failures": s.env_failures, "episodes_truncated": s.episodes_truncated,
                      "env_wait_seconds": s.env_wait_seconds}
        if c.env.calls is not None:
            out["env"]["calls"] = {o: c.env.calls[o] for o in OUTCOMES}
            out["env"]["retries"] = c.env.retries
    if env is not None:  # the agent driver's
        out["env"] = env
    if chat is not None:
        out.update(openai_answers_spliced=chat[0], openai_splice_refused=chat[1])
    out.update(engine_id=c.engine_id, version=c.version, channel_send_failures=6, running_batches=1, pid=4242,
               incarnation="4242.1")
    return out


def _stats(c: RolloutCounters, chat: ChatCounters | None = None) -> EngineStats:
    return EngineStats("pool-engine-0", 2, pid=4242, incarnation="4242.1", running_batches=1, channel_send_failures=6,
                       counters=c, chat=chat)


def test_engine_stats_flatten_to_the_keys_order_and_values_of_before():
    plain = _counters(None)
    assert list(_stats(plain).as_dict().items()) == list(_before(plain, None, None).items())
    assert "env" not in _stats(plain).as_dict() and "openai_answers_spliced" not in _stats(plain).as_dict()

    rollout_env = EnvCounters("judge", episodes=12, env_failures=1, env_wait_seconds=1.5, turns=30, env_tokens=77,
                              episodes_truncated=2)
    c = _counters(rollout_env)
    assert list(_stats(c).as_dict().items()) == list(_before(c, None, None).items())
    served = _counters(dataclasses.replace(rollout_env, calls={o: i for i, o in enumerate(OUTCOMES)}, retries=3))
    assert list(_stats(served).as_dict().items()) == list(_before(served, None, None).items())

    agent = EnvCounters("calc", episodes=2, env_failures=1, env_wait_seconds=0.5, calls={"ok": 1, "bad_reward": 1},
                        retries=0)
    by_agent = dataclasses.replace(c, env=agent)
    before = _before(c, {"name": "calc", "episodes": 2, "env_failures": 1, "env_wait_seconds": 0.5,
                         "calls": {"ok": 1, "bad_reward": 1}, "retries": 0}, (7, 1))
    got = _stats(by_agent, ChatCounters(answers_spliced=7, splice_refused=1)).as_dict()
    assert list(got.items()) == list(before.items())
    assert list(got["env"]) == ["name", "episodes", "env_failures", "env_wait_seconds", "calls", "retries"]
    assert got["phases_last"] == dataclasses.asdict(PauseBreakdown(verify_s=0.125, install_s=0.5))


def test_the_pools_engine_stats_answer_typed_replies_with_the_flat_counters():
    """``Fleet.engine_stats`` (the pool's ``engine_stats``) answers each engine's
    :class:`~protocol.pool_replies.EngineStatsReply`: the fields the job's parity probe reads, the flat dict as its
    counters; an engine that does not answer gets only its error."""
    async def dead():
        raise RuntimeError("RayActorError: the actor died")

    gone = pool_fakes.FakeEngine(ok=True)
    gone.stats = ActorMethod(dead)
    replies = asyncio.run(pool_fakes.fleet_of({"e0": pool_fakes.FakeEngine(ok=True), "e1": gone}).engine_stats())

    stats = pool_fakes.engine_stats(incarnation="1")
    assert replies["e0"] == EngineStatsReply("fake", version=0, pid=1, incarnation="1", refits=0,
                                             counters=stats.as_dict())
    assert list(replies["e0"].counters) == list(stats.as_dict())
    assert replies["e1"] == EngineStatsReply("e1", error=repr(RuntimeError("RayActorError: the actor died")))

    c = _counters(None)
    reply = _stats(c).reply()
    assert (reply.engine_id, reply.error, reply.version, reply.pid, reply.incarnation, reply.refits) == (
        "pool-engine-0", None, 2, 4242, "4242.1", 2)
    assert list(reply.counters.items()) == list(_before(c, None, None).items())
