"""Weights over one weight group (``policy.refit_transport: collective``): both halves of the handshake.

Rank 0 and the engines' vLLM workers form one ``WeightTransferGroup`` (NCCL on
GPU, gloo on CPU): the pool plans the ranks of the engines that are up
(:meth:`WeightGroup.plan`), rank 0 opens the group and every planned worker
joins. A push is three moves: the learner stages the HF tensors on rank 0's
device, the pool has every engine of the group receive and **install** the next
push (:meth:`WeightGroup.install`), and rank 0 broadcasts it in buckets. The
group is formed again whenever it no longer holds exactly the engine
incarnations that are up, or a push failed. The learner's side is
:class:`CollectiveRefit`; the step by step is in docs/architecture.md.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol.pool_client import Pending
from services.refit.learner_port import LearnerPort
from services.refit.port import PoolPort, engine_failures, fold_installs
from services.refit.result import GroupInstall, RefitResult

if TYPE_CHECKING:
    from services.recipe.config import Recipe

log = logging.getLogger("inflight.refit")
CALL_TIMEOUT_S = 10.0
"""Longest an engine may take to say how many workers it brings to a group."""


@dataclass(frozen=True)
class GroupPlan:
    """Ranks of a new weight group: rank 0 is the learner, an engine takes one rank per vLLM worker."""

    ranks: dict[str, int]
    """Engine id -> its first rank."""
    world_size: int


class GroupCalls:
    """The pool's calls a collective push makes, typed (``RolloutPool`` answers them)."""

    def __init__(self, handle: Any):
        self.handle = handle
        """The pool's DeploymentHandle."""

    def group_current(self) -> bool:
        """Whether the pool's group still holds exactly the engine incarnations that are up."""
        return self.handle.weight_group_current.remote().result(timeout_s=60)

    def plan(self, timeout_s: float) -> GroupPlan:
        return self.handle.weight_group_plan.remote(timeout_s).result(timeout_s=timeout_s + 60)

    def join(self, host: str, port: int, plan: GroupPlan, timeout_s: float) -> GroupPlan:
        return self.handle.join_weight_group.remote(host, port, plan, timeout_s).result(timeout_s=timeout_s + 90)

    def start_install(self, reset: bool, timeout_s: float) -> Pending[RefitResult]:
        """Every engine of the group waits for the next push (answered once it is installed)."""
        return Pending(self.handle.install_group_push.remote(reset, timeout_s))

    def engines_wanting_weights(self) -> list[str]:
        return self.handle.engines_wanting_weights.remote().result(timeout_s=60)


class CollectiveRefit:
    """The learner's side: buckets broadcast from rank 0's device to every engine worker over one weight group."""

    def __init__(self, recipe: Recipe, pool: Any, learner: LearnerPort):
        """``pool``: the pool's DeploymentHandle."""
        self.pool, self.learner = GroupCalls(pool), learner
        self.bucket_bytes = recipe.policy.refit_bucket_mb * 1024 * 1024
        self.timeout_s = recipe.policy.refit_timeout_s
        self.groups_formed = 0
        self._group_ok = False

    def push(self, reset: bool) -> RefitResult:
        if not self._group_ok or not self.pool.group_current():
            self._form_group()
            reset = True  # members that joined may hold any version
        self.learner.stage_weights()
        installing = self.pool.start_install(reset, self.timeout_s)
        try:
            sent = self.learner.send_staged(self.bucket_bytes)
            out = installing.result(timeout_s=self.timeout_s + 60)
        except Exception:
            self._group_ok = False  # re-formed before the next attempt
            _settle(installing, self.timeout_s + 60)  # the pool has dropped the group before we retry
            raise
        return dataclasses.replace(out, send_seconds=sent.seconds, groups_formed=self.groups_formed)

    def _form_group(self) -> None:
        plan = self.pool.plan(self.timeout_s)
        host, port = self.learner.weight_group_address()
        joining = self.learner.join_weight_group(host, port, plan.world_size, self.timeout_s)
        self.pool.join(host, port, plan, self.timeout_s)
        joining.wait()
        self._group_ok = True
        self.groups_formed += 1
        log.info("weight group %s:%d formed: %d engines, world size %d", host, port, len(plan.ranks),
                 plan.world_size)

    def engines_waiting(self) -> bool:
        """True if an engine is up without the current weights (restarted): it waits for a push."""
        waiting = self.pool.engines_wanting_weights()
        if waiting:
            log.info("engines %s are up without the current weights", waiting)
        return bool(waiting)


def _settle(response: Any, timeout_s: float) -> None:
    """Wait for a pool call to end, whatever its outcome."""
    try:
        response.result(timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - the caller raises its own error
        pass


class WeightGroup:
    """The pool's side: which engine incarnations are in the learner's weight group, and their installs."""

    def __init__(self, pool: PoolPort, refit_timeout_s: float):
        self.pool = pool
        self.refit_timeout_s = refit_timeout_s
        """How long the engines may take to install when the learner names no bound (``policy.refit_timeout_s``)."""
        self.members: dict[str, str | None] | None = None
        """Engine id -> its incarnation, while the group stands."""

    def current(self) -> bool:
        """True while the weight group holds exactly the engine incarnations that are up."""
        pool = self.pool
        return self.members is not None and self.members == {e: pool.incarnation(e) for e in pool.engines_up()}

    def wanting_weights(self) -> list[str]:
        """Engines that are up but not at the pool's version (restarted; waiting for a push)."""
        pool = self.pool
        return [e for e in pool.engines_up() if pool.engine_version(e) != pool.version]

    async def plan(self, timeout_s: float) -> GroupPlan:
        """Ranks a new weight group gives the engines that are up; waits at most ``timeout_s`` for one."""
        pool = self.pool
        await pool.some_engine_up(timeout_s)
        up = pool.engines_up()
        if not up:
            raise pool.refit_failed("?", {"pool": RuntimeError("no engine is up")})
        sizes = await asyncio.gather(*[asyncio.wait_for(pool.handles[e].weight_group_members.remote(),
                                                        CALL_TIMEOUT_S) for e in up])
        ranks, world = {}, 1
        for eid, n in zip(up, sizes, strict=True):
            ranks[eid], world = world, world + int(n)
        return GroupPlan(ranks, world)

    async def join(self, host: str, port: int, plan: GroupPlan, timeout_s: float) -> GroupPlan:
        """Have the planned engines join the learner's weight group at ``host:port`` (the learner joins as
        rank 0 at the same time); bounded by ``timeout_s``."""
        pool = self.pool
        async with pool.refit_lock:
            self.members = None
            eids = list(plan.ranks)
            results = await asyncio.gather(*[asyncio.wait_for(pool.handles[e].join_weight_group.remote(
                host, port, plan.ranks[e], plan.world_size, timeout_s), timeout_s + 60) for e in eids],
                return_exceptions=True)
            failed = engine_failures(pool, eids, results)
            if failed:
                raise pool.refit_failed("?", failed)
            self.members = {e: pool.incarnation(e) for e in eids}
            log.info("pool %s: weight group %s:%d formed with %s (world %d)", pool.name, host, port, eids,
                     plan.world_size)
            return plan

    async def install(self, reset: bool = False, timeout_s: float | None = None) -> RefitResult:
        """Every engine of the weight group receives the learner's next push and installs it in flight.

        Atomic per engine; the pool's version advances only if all of them installed it. Any failure drops
        the group (the learner re-forms it before its next attempt)."""
        pool = self.pool
        timeout_s = timeout_s or self.refit_timeout_s
        t0 = time.perf_counter()
        async with pool.refit_lock:
            if self.members is None:
                raise pool.refit_failed("?", {"pool": RuntimeError("no weight group: the learner must form "
                                                                   "one first (weight_group_plan)")})
            eids = list(self.members)
            calls_started = time.perf_counter()
            answers = await asyncio.gather(*[asyncio.wait_for(pool.handles[e].install_from_group.remote(reset),
                                                              timeout_s) for e in eids], return_exceptions=True)
            failed = engine_failures(pool, eids, answers)
            if failed:
                self.members = None
                raise pool.refit_failed("?", failed)
            results: list[GroupInstall] = [r for r in answers if isinstance(r, GroupInstall)]
            now = time.perf_counter()
            return fold_installs(pool, eids, results, now - t0, "collective", now - calls_started)
