"""Weights through the Ray object store (``policy.refit_transport: object_store``): both ends.

The learner **pushes** (:class:`ObjectStoreRefit`): rank 0 exports the HF-named
weights to host memory as CRC32-checked ``protocol.WeightBucket`` s in the
object store and hands their references to the pool. The pool fans them out
(:class:`ObjectStoreFanout`): it keeps its own copy, for engines that restart
later, and every engine that is up **installs** them (atomic per engine); the
pool's version advances only if every engine that is up installed it. Works on
any hardware; costs a device-to-host copy, a CRC32 and a file per push.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, cast

from protocol import WeightManifest, decode
from services.refit.learner_port import LearnerPort
from services.refit.port import KeptPush, PoolPort, land, record_install_metrics
from services.refit.result import GroupInstall, RefitResult, engine_gone, slowest

if TYPE_CHECKING:
    from services.recipe.config import Recipe

log = logging.getLogger("inflight.refit")
STATS_TIMEOUT_S = 10.0
"""Longest an engine may take to report how its install went (the push stands either way)."""


class ObjectStoreCalls:
    """The pool's call an object-store push makes, typed (``RolloutPool.push`` answers it)."""

    def __init__(self, handle: Any):
        self.handle = handle
        """The pool's DeploymentHandle."""

    def push(self, manifest_bytes: bytes, bucket_refs: list, reset: bool, timeout_s: float) -> RefitResult:
        return self.handle.push.remote(manifest_bytes, bucket_refs, reset).result(timeout_s=timeout_s)


class ObjectStoreRefit:
    """The learner's side: buckets through the Ray object store (the pool keeps them for engines that restart)."""

    def __init__(self, recipe: Recipe, pool: Any, learner: LearnerPort):
        """``pool``: the pool's DeploymentHandle."""
        self.pool, self.learner = ObjectStoreCalls(pool), learner
        self.bucket_bytes = recipe.policy.refit_bucket_mb * 1024 * 1024
        # the pool waits up to refit_timeout_s for an engine, again for the buckets, again for the engines
        self.timeout_s = 3 * recipe.policy.refit_timeout_s + 60

    def push(self, reset: bool) -> RefitResult:
        exported = self.learner.export_weights(self.bucket_bytes)
        return self.pool.push(exported.manifest_bytes, exported.bucket_refs, reset, self.timeout_s)

    def engines_waiting(self) -> bool:
        """The pool reinstalls its latest push on restarted engines itself: none ever wait for the learner."""
        return False


class ObjectStoreFanout:
    """The pool's side: every engine that is up installs the push; the pool keeps it for those that restart."""

    def __init__(self, pool: PoolPort, refit_timeout_s: float):
        self.pool = pool
        self.refit_timeout_s = refit_timeout_s
        """How long the buckets, and again the engines, may take when the learner names no bound
        (``policy.refit_timeout_s``)."""

    async def push(self, manifest_bytes: bytes, bucket_refs: list, reset: bool = False,
                   timeout_s: float | None = None) -> RefitResult:
        """Install one version on every engine that is up, within ``timeout_s`` (default
        ``policy.refit_timeout_s``) for the buckets and again for the engines. Engines that are down, or die
        during the push, get it from the watcher before they serve again."""
        import ray

        pool = self.pool
        timeout_s = timeout_s or self.refit_timeout_s
        t0 = time.perf_counter()
        await pool.some_engine_up(timeout_s)
        async with pool.refit_lock:
            try:
                manifest = cast(WeightManifest, decode(manifest_bytes, expect=WeightManifest))
                # The pool keeps its own copy of the buckets for engines that restart later.
                datas = await asyncio.wait_for(asyncio.gather(*bucket_refs), timeout_s)
            except Exception as exc:  # noqa: BLE001 - classified, counted and raised with the cause
                raise pool.refit_failed("?", {"pool": exc}) from None
            owned = [ray.put(d) for d in datas]
            targets = pool.engines_up()
            # An engine that installed this very version in an attempt that failed elsewhere keeps it: the
            # learner's retry would otherwise be rejected there as "not newer" (a reset push installs again).
            installed = [] if reset else [e for e in targets if pool.engine_version(e) == manifest.version]
            targets = [e for e in targets if e not in installed]
            results = await asyncio.gather(*[self._install(eid, manifest_bytes, owned, reset, timeout_s)
                                             for eid in targets], return_exceptions=True)
            failed: dict[str, BaseException] = {}
            reports: list[GroupInstall] = []
            for eid, res in zip(targets, results, strict=True):
                if not isinstance(res, BaseException):
                    installed.append(eid)
                    reports += [res] if res is not None else []
                elif engine_gone(res):  # restarted later with the latest weights
                    pool.mark_down(eid, res)
                else:
                    failed[eid] = res
            if failed or not installed:
                raise pool.refit_failed(manifest.version, failed or {"pool": RuntimeError("no engine is up")})
            seconds = time.perf_counter() - t0
            land(pool, manifest.version, seconds, manifest.total_bytes * len(installed),
                 kept=KeptPush(manifest_bytes, owned))
            return RefitResult(version=manifest.version, seconds=seconds, bytes=manifest.total_bytes,
                               engines=len(installed),
                               pause_seconds_max=max((r.pause_s for r in reports), default=None),
                               install_seconds_max=max((r.install_s for r in reports), default=None),
                               transport="object_store", phases=slowest([r.phases for r in reports if r.phases]))

    async def reinstall(self, eid: str) -> bool:
        """Install the kept push on ``eid`` (``reset=True``: a restarted engine, whatever version it holds);
        False if the pool keeps none any more (a collective push landed meanwhile)."""
        async with self.pool.refit_lock:
            # Read again under the lock: a push may have landed meanwhile. A collective one clears the kept
            # push (reading it unchecked raised TypeError and marked a healthy engine down).
            kept = self.pool.kept
            if kept is None:
                return False
            await self._install(eid, kept.manifest_bytes, kept.refs, reset=True)
            return True

    async def _install(self, eid: str, manifest_bytes: bytes, refs: list, reset: bool,
                       timeout_s: float | None = None) -> GroupInstall | None:
        """Install on ``eid``; returns how it went (its pause and phases, counted in the pool's metrics), or
        None if the engine did not say in time (the install stands)."""
        timeout_s = timeout_s or self.refit_timeout_s
        handle = self.pool.handles[eid]
        version = await asyncio.wait_for(handle.install.remote(manifest_bytes, refs, reset), timeout_s)
        self.pool.installed(eid, version)
        try:
            stats = await asyncio.wait_for(handle.stats.remote(), STATS_TIMEOUT_S)  # the engine actor's EngineStats
            report = GroupInstall.of(version, stats.counters.installs)
        except Exception as exc:  # noqa: BLE001 - the install stands; only its report is missing
            log.warning("engine %s installed v%d but did not report how: %s", eid, version, exc)
            return None
        record_install_metrics(self.pool.metrics, report, held=False)
        return report
