"""RolloutEngine.counters() (rollout/counters.py): typed copies of the engine's counters, whose ``as_dict`` is the
very dict ``RolloutEngine.stats()`` answered before they were typed (same keys, order and values)."""
from __future__ import annotations

import dataclasses
import types
from typing import Any

from rollout.config import GenerationConfig
from rollout.engine import RolloutEngine
from rollout.episodes.environment import BoundedEnvironment
from rollout.install.installer import PauseBreakdown
from rollout.rewards.registry import get_reward_fn

OUTCOMES = ("ok", "failed_step", "timeout", "http_5xx", "http_4xx", "malformed", "connection")


class Env:
    name = "judge"

    def __init__(self, served: bool):
        if served:  # an environment server's client keeps call counters (rollout.episodes.env_http.EnvCallStats)
            self.stats = types.SimpleNamespace(retries=3, **{o: i for i, o in enumerate(OUTCOMES)})

    def reset(self, task):
        raise NotImplementedError

    def step(self, state, answer):
        raise NotImplementedError


def _before(engine: RolloutEngine) -> dict[str, Any]:
    """``RolloutEngine.stats()`` as it was built before (commit 9a1468b)."""
    out: dict[str, Any] = {**vars(engine.sampler.stats), **engine.installer.stats.as_dict()}
    out.update(sleeps_skipped_on_cpu=0, version=engine.version, engine_id=engine.engine_id,
               weights_broken=engine.installer.broken, **engine._kv.as_stats(), vllm_unfinished_requests=0)
    if (env := engine.sampler.environment) is not None:
        s = engine.sampler.stats
        out["env"] = {"name": env.name, "episodes": s.episodes, "turns": s.turns, "env_tokens": s.env_tokens,
                      "env_failures": s.env_failures, "episodes_truncated": s.episodes_truncated,
                      "env_wait_seconds": s.env_wait_seconds}
        calls = getattr(env.env, "stats", None)
        if calls is not None and hasattr(calls, "retries"):
            out["env"]["calls"] = {o: int(getattr(calls, o)) for o in OUTCOMES}
            out["env"]["retries"] = int(calls.retries)
    return out


def _engine(env: Env | None) -> RolloutEngine:
    engine = RolloutEngine("/nonexistent", GenerationConfig(max_new_tokens=8), 64, get_reward_fn("format"),
                           engine_id="e7", environment=None if env is None else BoundedEnvironment(env, 5.0))
    engine.sampler.stats.groups, engine.sampler.stats.tokens_generated, engine.sampler.stats.turns = 2, 40, 5
    engine.sampler.stats.env_wait_seconds = 0.75
    engine.installer.stats.refits, engine.installer.stats.install_path_last = 1, "reload"
    engine.installer.stats.phases_last = PauseBreakdown(verify_s=0.5, install_s=0.25)
    engine._kv.kv_preemptions = 3
    return engine


def test_stats_are_the_counters_flattened_as_before():
    for env in (None, Env(served=False), Env(served=True)):
        engine = _engine(env)
        assert list(engine.stats().items()) == list(_before(engine).items())
        assert (engine.counters().env is None) == (env is None)


def test_counters_are_a_copy():
    engine = _engine(Env(served=True))
    counters = engine.counters()
    engine.sampler.stats.groups += 1
    engine.installer.stats.phases_last.install_s = 9.0
    engine._kv.kv_preemptions += 1
    assert counters.sampling.groups == 2 and counters.installs.phases_last.install_s == 0.25
    assert counters.kv.kv_preemptions == 3 and counters.installs.refits == 1
    assert counters.env is not None and counters.env.calls == {o: i for i, o in enumerate(OUTCOMES)}
    assert counters.env.retries == 3 and counters.env.turns == 5
    assert dataclasses.asdict(counters.installs.phases_last)["verify_s"] == 0.5
