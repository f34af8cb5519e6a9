"""Collective pushes: the learner forms the weight group once and again after a failed send; the pool's side plans
ranks per vLLM worker, tracks incarnations, and advances its version only when every member installed."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import RayTaskError

from rollout.install.weight_receiver import WeightUpdateError
from services.recipe.config import load_recipe
from services.refit import CollectiveRefit, RefitError, RefitResult
from services.refit.collective import GroupPlan, WeightGroup
from services.refit.learner_port import SentPush
from services.refit.port import KeptPush
from services.refit.result import GroupInstall
from handle_fakes import ActorMethod, ServeMethod
from port_fakes import FakePool


class _GroupPool:
    """The pool's side of a collective push: the group is current until a push fails."""

    def __init__(self):
        self.current, self.joined, self.received = False, 0, []
        self.weight_group_current = ServeMethod(lambda: self.current)
        self.weight_group_plan = ServeMethod(lambda timeout: GroupPlan({"e0": 1}, 2))
        self.join_weight_group = ServeMethod(self._join)
        self.install_group_push = ServeMethod(self._install)

    def _join(self, host, port, plan, timeout):
        self.joined += 1
        self.current = True

    def _install(self, reset, timeout):
        self.received.append(reset)
        return RefitResult(version=1, seconds=0.1, bytes=10, engines=1)


class _GroupLearner:
    """The learner's side of a collective push (``LearnerPort``); its first ``fail_sends`` sends fail."""

    def __init__(self, fail_sends: int):
        self.fail_sends, self.calls = fail_sends, []

    def weight_group_address(self):
        self.calls.append("weight_group_address")
        return "127.0.0.1", 1234

    def join_weight_group(self, host, port, world_size, timeout_s):
        self.calls.append("join_weight_group")
        return SimpleNamespace(wait=lambda: None)

    def stage_weights(self):
        self.calls.append("stage_weights")

    def send_staged(self, bucket_bytes):
        self.calls.append("send_staged")
        if self.fail_sends:
            self.fail_sends -= 1
            raise RuntimeError("gloo: connection reset by peer")
        return SentPush(version=1, bytes=10, seconds=0.05)


def test_collective_refit_forms_the_group_once_and_again_after_a_failed_send():
    recipe = load_recipe(None, ["policy.refit_timeout_s=1.0"])
    pool, learner = _GroupPool(), _GroupLearner(fail_sends=0)
    refit = CollectiveRefit(recipe, pool, learner)
    out = refit.push(reset=False)
    assert out.groups_formed == 1 and out.send_seconds == 0.05 and pool.received == [True]  # new members: any version
    refit.push(reset=False)
    assert pool.joined == 1 and pool.received == [True, False]    # the group is current: no new one
    learner.fail_sends = 1
    with pytest.raises(RuntimeError, match="connection reset"):
        refit.push(reset=False)
    refit.push(reset=False)                                         # the next attempt re-forms the group
    assert pool.joined == 2 and refit.groups_formed == 2 and pool.received[-1] is True


class _Member:
    """An engine of ``workers`` vLLM workers that joins groups and installs their pushes (or rejects one)."""

    def __init__(self, workers: int, reject: bool = False):
        self.workers, self.reject, self.joined = workers, reject, []

        async def members():
            return self.workers

        async def join(host, port, rank_base, world_size, timeout_s):
            self.joined.append((rank_base, world_size))
            return list(range(rank_base, rank_base + self.workers))

        async def install(reset):
            if self.reject:
                cause = WeightUpdateError("device checksum mismatch")
                raise RayTaskError("EngineActor.install_from_group", "...", cause).as_instanceof_cause()
            return GroupInstall(version=5, bytes=100, pause_s=0.02, install_s=0.01, install_path="reload")

        self.weight_group_members, self.join_weight_group = ActorMethod(members), ActorMethod(join)
        self.install_from_group = ActorMethod(install)


def test_the_pools_weight_group_plans_ranks_tracks_incarnations_and_installs_atomically():
    async def scenario():
        members = {"e0": _Member(2), "e1": _Member(1)}
        pool = FakePool(members)
        pool.kept = KeptPush(b"m", [])
        group = WeightGroup(pool, refit_timeout_s=1.0)
        with pytest.raises(RefitError, match="no weight group"):
            await group.install()
        plan = await group.plan(1.0)
        assert plan == GroupPlan({"e0": 1, "e1": 3}, 4)                 # rank 0 is the learner
        await group.join("h", 1, plan, 1.0)
        assert group.current() and members["e1"].joined == [(3, 4)]
        out = await group.install(reset=True)
        assert out == RefitResult(version=5, seconds=out.seconds, bytes=100, engines=2, pause_seconds_max=0.02,
                                  install_seconds_max=0.01, install_paths=("reload",), transport="collective",
                                  engine_call_seconds=out.engine_call_seconds, engine_seconds=0.0,
                                  engine_loop_lag_seconds=0.0, pool_loop_lag_seconds=0.0)
        assert out.engine_call_seconds is not None and 0 <= out.engine_call_seconds <= out.seconds
        assert pool.version == 5 and pool.kept is None and pool.versions == {"e0": 5, "e1": 5}
        assert pool.metrics.refit_bytes._value.get() == 200 and pool.metrics.weight_installs.labels(
            path="reload")._value.get() == 2
        members["e1"].reject = True
        with pytest.raises(RefitError, match="rejected"):
            await group.install()
        assert pool.version == 5 and group.members is None and not group.current()   # the group is dropped
        pool.restarted("e1", members["e1"], "1.2")                      # restarted: waits for the learner
        assert group.wanting_weights() == ["e1"]

    asyncio.run(scenario())
