"""Weights through CUDA IPC (``policy.refit_transport: cuda_ipc``): a colocated learner's buffers, mapped in place.

When the pool's engine runs on the learner's rank-0 GPU (colocated on one GPU),
a push never leaves that GPU. The learner **pushes** (:class:`CudaIpcRefit`):
rank 0 packs the HF-named weights into buckets on its GPU with their device
checksums and shares each bucket through a CUDA IPC handle
(``learner/ipc_export.py``); only the manifest and the handles (a few hundred
bytes each) travel, through Ray. The pool (:class:`IpcFanout`) has the engine
map the buckets, check them on the device and **install** them in flight,
copying straight out of the learner's memory (``rollout/install/ipc_receiver.py``);
the learner keeps the buffers until the pool has answered and frees them then,
whatever the outcome. Atomic per engine like every transport; the pool keeps
no copy, so an engine that restarts waits for the learner's next push.

Where that cannot work -- on CPU, with an engine on another GPU or of several
workers, or several engines on the GPU (a bucket's IPC share is counted for one
process) -- every push goes through the object store instead
(:class:`services.refit.object_store.ObjectStoreRefit`), and the reason is
logged once. docs/architecture.md ("Weight transports") has the steps.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.refit.learner_port import LearnerPort
from services.refit.object_store import ObjectStoreRefit
from services.refit.port import PoolPort, engine_failures, fold_installs
from services.refit.result import GroupInstall, RefitResult

if TYPE_CHECKING:
    from services.recipe.config import Recipe

log = logging.getLogger("inflight.refit")
CALL_TIMEOUT_S = 30.0
"""Longest an engine may take to name its GPUs (its first answer waits for the vLLM workers)."""


@dataclass(frozen=True)
class IpcPlan:
    """Which engines that are up could map buffers of the learner's GPU ``gpu``."""

    gpu: str
    """The UUID of the learner's rank-0 GPU ('' without one)."""
    sharing: tuple[str, ...]
    """Engines whose only GPU is ``gpu``."""
    others: tuple[str, ...]
    """Engines on other GPUs, or on several."""

    def refusal(self) -> str:
        """Why a CUDA IPC push cannot reach every engine that is up ('' when it can)."""
        if not self.gpu:
            return "the learner's rank 0 has no GPU"
        if self.others:
            return (f"engines {list(self.others)} do not run on the learner's GPU {self.gpu} alone (CUDA IPC "
                    f"needs each engine on the learner's GPU, with one worker)")
        if not self.sharing:
            return "no engine is up"
        if len(self.sharing) > 1:
            return (f"engines {list(self.sharing)} share the learner's GPU; a bucket's CUDA IPC share is "
                    f"counted for one process")
        return ""


class IpcCalls:
    """The pool's calls a CUDA IPC push makes, typed (``RolloutPool`` answers them)."""

    def __init__(self, handle: Any):
        self.handle = handle
        """The pool's DeploymentHandle."""

    def plan(self, gpu: str) -> IpcPlan:
        return self.handle.ipc_plan.remote(gpu).result(timeout_s=CALL_TIMEOUT_S + 30)

    def install(self, manifest_bytes: bytes, shares: list, gpu: str, reset: bool, timeout_s: float) -> RefitResult:
        return self.handle.install_ipc_push.remote(manifest_bytes, shares, gpu, reset, timeout_s).result(
            timeout_s=timeout_s + 60)

    def engines_wanting_weights(self) -> list[str]:
        return self.handle.engines_wanting_weights.remote().result(timeout_s=60)


class CudaIpcRefit:
    """The learner's side: rank 0 shares its GPU buckets with the engine on its GPU, else the object store."""

    def __init__(self, recipe: Recipe, pool: Any, learner: LearnerPort):
        """``pool``: the pool's DeploymentHandle."""
        self.pool, self.learner = IpcCalls(pool), learner
        self.bucket_bytes = recipe.policy.refit_bucket_mb * 1024 * 1024
        self.cuda_graph = recipe.policy.refit_cuda_graph
        self.timeout_s = recipe.policy.refit_timeout_s
        self.fallback = ObjectStoreRefit(recipe, pool, learner)
        self.last_transport = ""
        """How the last push went: ``cuda_ipc`` or ``object_store``."""
        self._gpu: str | None = None
        self._fallback_reason = ""

    def push(self, reset: bool) -> RefitResult:
        if self._gpu is None:
            self._gpu = self.learner.gpu_uuid()
        plan = self.pool.plan(self._gpu)
        if why := plan.refusal():
            if why != self._fallback_reason:
                log.warning("refit: cuda_ipc cannot reach every engine (%s); pushing through the object store", why)
                self._fallback_reason = why
            self.last_transport = "object_store"
            return self.fallback.push(reset)
        started = time.perf_counter()
        exported = self.learner.export_ipc(self.bucket_bytes, self.cuda_graph)
        export_seconds = time.perf_counter() - started
        installed = False
        try:
            out = self.pool.install(exported.manifest_bytes, exported.shares, self._gpu, reset, self.timeout_s)
            installed = True
        finally:
            self.learner.release_ipc(failed=not installed)  # every engine has answered, or given up
        self.last_transport, self._fallback_reason = "cuda_ipc", ""
        return dataclasses.replace(out, send_seconds=export_seconds)

    def engines_waiting(self) -> bool:
        """True if an engine is up without the current weights (restarted after a CUDA IPC push, of which the
        pool keeps no copy): it waits for a push. After an object-store push the pool reinstalls it itself."""
        if self.last_transport != "cuda_ipc":
            return False
        waiting = self.pool.engines_wanting_weights()
        if waiting:
            log.info("engines %s are up without the current weights", waiting)
        return bool(waiting)


class IpcFanout:
    """The pool's side: the engine on the learner's GPU maps, checks and installs the shared buckets."""

    def __init__(self, pool: PoolPort, refit_timeout_s: float):
        self.pool = pool
        self.refit_timeout_s = refit_timeout_s
        """How long the engine may take to install when the learner names no bound (``policy.refit_timeout_s``)."""
        self._gpus: dict[str, tuple[str | None, tuple[str, ...]]] = {}
        """Engine id -> (incarnation, its workers' GPU UUIDs), asked once per incarnation."""

    async def plan(self, gpu: str) -> IpcPlan:
        """Which engines that are up have ``gpu`` as their only GPU."""
        up = self.pool.engines_up()
        gpus = await asyncio.gather(*[self._engine_gpus(e) for e in up])
        sharing = tuple(e for e, g in zip(up, gpus, strict=True) if gpu and g == (gpu,))
        return IpcPlan(gpu, sharing, tuple(e for e in up if e not in sharing))

    async def _engine_gpus(self, eid: str) -> tuple[str, ...]:
        incarnation = self.pool.incarnation(eid)
        known = self._gpus.get(eid)
        if known is None or known[0] != incarnation:
            uuids = await asyncio.wait_for(self.pool.handles[eid].gpu_uuids.remote(), CALL_TIMEOUT_S)
            known = self._gpus[eid] = (incarnation, tuple(uuids))
        return known[1]

    async def install(self, manifest_bytes: bytes, shares: list, gpu: str, reset: bool = False,
                      timeout_s: float | None = None) -> RefitResult:
        """The engine on ``gpu`` installs the push from the learner's shared buckets, within ``timeout_s``
        (default ``policy.refit_timeout_s``); the pool's version advances only if it did."""
        pool = self.pool
        timeout_s = timeout_s or self.refit_timeout_s
        started = time.perf_counter()
        await pool.some_engine_up(timeout_s)
        async with pool.refit_lock:
            plan = await self.plan(gpu)
            if why := plan.refusal():  # the engines changed since the learner asked
                raise pool.refit_failed("?", {"pool": RuntimeError(f"cuda_ipc: {why}")})
            eids = list(plan.sharing)
            calls_started = time.perf_counter()
            answers = await asyncio.gather(*[asyncio.wait_for(
                pool.handles[e].install_ipc.remote(manifest_bytes, shares, reset), timeout_s) for e in eids],
                return_exceptions=True)
            failed = engine_failures(pool, eids, answers)
            if failed:
                raise pool.refit_failed("?", failed)
            results = [r for r in answers if isinstance(r, GroupInstall)]
            now = time.perf_counter()
            return fold_installs(pool, eids, results, now - started, "cuda_ipc", now - calls_started)
