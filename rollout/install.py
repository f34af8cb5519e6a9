"""The receiver's install: a verified weight push goes into a running vLLM engine, in flight.

One install at a time (a lock): verify the push before touching the engine (a
bad push raises :class:`WeightUpdateError` and the old version keeps serving),
pause (``keep``: running requests stay), install (``reload_weights`` from a
staged safetensors file, then :mod:`rollout.cpu_reload`; or the workers' install of a push they received over
the weight group: direct load / copy plan / reload, :mod:`rollout.direct_load`),
reset the prefix cache, set the version label, advance the version, and always
resume. A failure inside the pause leaves the weights marked broken until a
complete push succeeds. docs/rollout.md ("In-flight weight update") has the steps.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from protocol import WeightBucket, WeightManifest, decode
from rollout.errors import EngineError, bounded
from rollout.labels import VersionLabels
from rollout.liveness import EngineDead, dead_reason
from rollout.weight_receiver import (
    ExpectedParams,
    WeightUpdateError,
    remove_staged,
    stage_push,
    verify_manifest,
    verify_push,
)

T = TypeVar("T")


@dataclass
class InstallStats:
    """Install counters, part of ``RolloutEngine.stats()``."""

    refits: int = 0
    """Pushes installed."""
    refit_rejected: int = 0
    """Pushes rejected before the pause, or whose install failed inside it."""
    refit_seconds_total: float = 0.0
    """Seconds spent in installs since the engine started."""
    refit_seconds_last: float = 0.0
    """Seconds of the last install."""
    pause_seconds_last: float = 0.0
    """Seconds generation was paused by the last install."""
    install_seconds_last: float = 0.0
    """Time of the workers' install (reload or direct load) inside the last pause."""
    install_path_last: str = ""
    """How the last collective push was installed: ``reload``, ``direct``, ``copy`` or ``checked``
    (rollout.direct_load)."""
    direct_load_refused: str = ""
    """Why plain ``load_weights`` is not used for this model (empty: proven, or not checked yet)."""
    copy_plan_refused: str = ""
    """Why the copy plan of ``rollout.direct_load`` is not used (empty: proven, or not checked yet)."""
    refit_bytes_total: int = 0
    """Bytes of weights installed since the engine started."""
    refit_bytes_last: int = 0
    """Bytes of the last installed push."""
    prefix_cache_reset_deferred: int = 0
    """Installs whose prefix-cache reset was refused (blocks of running requests still in use); new requests are
    salted by version instead."""
    version_drain_incomplete: int = 0
    """Installs where the front end had not delivered every pre-pause output in time (streamed labels)."""
    last_error: str = ""


class Installer:
    """The version an engine serves and the one-at-a-time install of new weights into it."""

    def __init__(self, engine_id: str, labels: VersionLabels, version: int, *, recompute_kv: bool,
                 in_flight: bool, timeout_s: float):
        self.engine_id = engine_id
        self.labels = labels
        self.version = version
        """The version being served; advances only once an install has fully succeeded."""
        self.recompute_kv_cache_after_weight_updates = recompute_kv
        self.pause_mode = "keep" if in_flight else "wait"
        """``keep``: running requests freeze during an install and continue with the new weights (in flight);
        ``wait``: the install waits until running requests finish (no request mixes versions)."""
        self.timeout_s = timeout_s
        self.expected: ExpectedParams | None = None
        """The model's parameters (names, shapes, dtypes); set when the engine starts."""
        self.broken = ""
        """Why the workers may hold a mix of weights (an install failed inside the pause); '' when consistent."""
        self.stats = InstallStats()
        self._lock = asyncio.Lock()

    def require_consistent(self) -> None:
        """Raise :class:`EngineError` while the weights are broken by a failed install."""
        if self.broken:
            raise EngineError(f"rollout engine {self.engine_id}: weights are inconsistent after a failed "
                              f"reload ({self.broken}); push a complete set of weights first")

    async def _bounded(self, llm: Any, awaitable: Awaitable[T], what: str, seconds: float | None = None) -> T:
        """Await a step of an install on ``llm`` within its deadline, abandoned as soon as ``llm``'s core dies."""
        return await bounded(awaitable, self.timeout_s if seconds is None else seconds, what, self.engine_id,
                             dead=lambda: dead_reason(llm))

    def _expected_params(self) -> ExpectedParams:
        if self.expected is None:
            raise EngineError(f"rollout engine {self.engine_id}: not started (call start())")
        return self.expected

    async def install(self, llm: Any, manifest: WeightManifest, buckets: list[WeightBucket], *,
                      reset: bool = False) -> int:
        """Verify and stage a complete push, then install it with ``reload_weights``; returns the new version."""
        expected = self._expected_params()
        async with self._lock:
            started = time.perf_counter()
            try:
                tensors = await asyncio.to_thread(verify_push, manifest, buckets, expected,
                                                  None if reset else self.version)
                staged = await asyncio.to_thread(stage_push, tensors, manifest.version, self.engine_id)
            except WeightUpdateError as exc:
                self.stats.refit_rejected += 1
                self.stats.last_error = str(exc)
                raise
            try:
                await self._paused_install(llm, manifest.version, lambda: llm.collective_rpc(
                    "inflight_reload_weights", kwargs={"weights_path": str(staged)}))
            finally:
                remove_staged(staged)
            self._record(started, manifest.total_bytes)
            return self.version

    async def join_group(self, llm: Any, host: str, port: int, rank_base: int, world_size: int,
                         timeout_s: float) -> list[int]:
        """Have every worker join the learner's weight group (ranks ``rank_base ..``); returns their ranks."""
        async with self._lock:
            return await self._bounded(llm, llm.collective_rpc("inflight_join_weight_group",
                                                          args=(host, port, rank_base, world_size, timeout_s)),
                                       f"joining the weight group at {host}:{port}", timeout_s + 30)

    async def install_from_group(self, llm: Any, *, reset: bool = False, direct_load: bool = True) -> int:
        """Have the workers receive the group's next push, check its manifest, and install it; returns the
        new version. ``direct_load``: the workers may prove and use plain ``load_weights`` / the copy plan."""
        expected = self._expected_params()
        async with self._lock:
            started = time.perf_counter()
            try:
                encoded = await self._bounded(llm, llm.collective_rpc("inflight_receive_weights"),
                                              "receiving a weight push from the weight group")
                manifests = [decode(e, expect=WeightManifest) for e in encoded]
                manifest = manifests[0]
                if any(m.checksum != manifest.checksum for m in manifests):
                    raise WeightUpdateError("the workers received different pushes")
                verify_manifest(manifest, expected, None if reset else self.version)
            except Exception as exc:
                self.stats.refit_rejected += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"[:500]
                await self._bounded(llm, llm.collective_rpc("inflight_drop_received"), "dropping a rejected push")
                if isinstance(exc, WeightUpdateError):
                    raise
                raise WeightUpdateError(f"rollout engine {self.engine_id}: weight push not received: "
                                        f"{self.stats.last_error}") from exc
            installed = await self._paused_install(llm, manifest.version, lambda: llm.collective_rpc(
                "inflight_install_received", args=(manifest.version, direct_load)))
            self.stats.install_path_last = installed[0]["path"]
            self.stats.direct_load_refused = installed[0]["refused_reason"]
            self.stats.copy_plan_refused = installed[0]["copy_refused_reason"]
            self._record(started, manifest.total_bytes)
            return self.version

    def _record(self, started: float, nbytes: int) -> None:
        elapsed = time.perf_counter() - started
        self.stats.refits += 1
        self.stats.refit_seconds_last = elapsed
        self.stats.refit_seconds_total += elapsed
        self.stats.refit_bytes_total += nbytes
        self.stats.refit_bytes_last = nbytes

    async def _paused_install(self, llm: Any, version: int, install: Callable[[], Awaitable[Any]]) -> Any:
        """Pause (``pause_mode``), ``await install()`` (the workers load their weights), reset the prefix
        cache, relabel, advance the version, and always resume; returns what ``install()`` returned."""
        paused_at = time.perf_counter()
        await self._bounded(llm, pause(llm, self.pause_mode, self.recompute_kv_cache_after_weight_updates,
                                  settle=self.labels.streamed), "pause_generation before a weight update")
        try:
            if not await self.labels.drain(llm):
                self.stats.version_drain_incomplete += 1
            try:
                install_started = time.perf_counter()
                installed = await self._bounded(llm, install(), f"reload_weights of v{version}")
                self.stats.install_seconds_last = time.perf_counter() - install_started
                if not await self._bounded(llm, llm.reset_prefix_cache(), "reset_prefix_cache"):
                    # Blocks of running requests are still in use; new requests are salted by version instead.
                    self.stats.prefix_cache_reset_deferred += 1
                await self._bounded(llm, self.labels.set_label(llm, version), "update_weight_version")
            except EngineDead:
                raise  # nothing of this engine will serve again: it is restarted, not marked broken
            except Exception as exc:
                # The workers may hold a mix of old and new weights: refuse to sample until a push succeeds.
                self.broken = f"installing v{version} failed: {type(exc).__name__}: {exc}"
                self.stats.refit_rejected += 1
                self.stats.last_error = self.broken
                raise WeightUpdateError(f"rollout engine {self.engine_id}: {self.broken}") from exc
            self.version = version
            self.labels.mark_running(version)  # still paused: the running samples' counts are final for v-1
            self.broken = ""
        finally:
            await self._bounded(llm, llm.resume_generation(), "resume_generation after a weight update")
            self.stats.pause_seconds_last = time.perf_counter() - paused_at
        return installed


async def pause(llm: Any, mode: str, clear_cache: bool, settle: bool) -> None:
    """Pause generation. ``AsyncLLM.pause_generation`` (vLLM 0.25.1 and 0.32) ends with a fixed 20 ms sleep
    that gives the front end time to deliver the outputs produced before the pause. With engine-side
    version labels (``settle`` False) nothing depends on that, and the engine client is paused directly.
    With streamed labels (``settle``) the full ``pause_generation`` is kept (docs/rollout.md, step 3).
    Also ``pause_generation`` where the client has no ``pause_scheduler_async``."""
    core = getattr(llm, "engine_core", None)
    if settle or core is None or not hasattr(core, "pause_scheduler_async"):
        await llm.pause_generation(mode=mode, clear_cache=clear_cache)
        return
    if clear_cache and hasattr(getattr(llm, "renderer", None), "clear_mm_cache_async"):
        await llm.renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)
