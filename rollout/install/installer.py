"""The receiver's install: a verified weight push goes into a running vLLM engine, in flight.

One install at a time (a lock): verify the push before touching the engine (a
bad push raises :class:`WeightUpdateError` and the old version keeps serving),
pause (``keep``: running requests stay), let the front end deliver the outputs
produced before the pause (streamed labels only), install (``reload_weights``
from a staged safetensors file, then :mod:`rollout.install.cpu_reload`; or the workers'
install of a push they hold already, received over the weight group or mapped
through CUDA IPC: direct load / copy plan / reload, :mod:`rollout.install.direct_load`),
set the version label, advance the version, and always resume; the prefix
cache is reset after the resume (requests are salted by version, so no request
can meet an old-weight block meanwhile). A failure inside the pause leaves the
weights marked broken until a complete push succeeds. Every step is timed
(:class:`PauseBreakdown`). docs/rollout.md ("In-flight weight update") has the steps.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from protocol import WeightBucket, WeightManifest, decode, encode
from rollout.errors import EngineError, bounded
from rollout.install.weight_receiver import (
    ExpectedParams,
    WeightUpdateError,
    remove_staged,
    stage_push,
    verify_manifest,
    verify_push,
)
from rollout.labels import VersionLabels
from rollout.liveness import EngineDead, dead_reason

T = TypeVar("T")


@dataclass
class PauseBreakdown:
    """Where the seconds of one install went: before the pause, inside it (in order), and after it."""

    verify_s: float = 0.0
    """Before the pause: the push's checks on the host (object store: CRC32 of every bucket; all: names,
    shapes, dtypes and version order)."""
    stage_s: float = 0.0
    """Before the pause: writing an object-store push as a safetensors file in ``/dev/shm``."""
    receive_s: float = 0.0
    """Before the pause: the workers take the push in and check it on the device (weight group: the broadcast;
    CUDA IPC: mapping the learner's buffers)."""
    pause_s: float = 0.0
    """Asking the engine core to pause: returns once the step in progress has ended."""
    settle_s: float = 0.0
    """A fixed wait after the pause (:attr:`PauseSettings.settle_s`; vLLM's ``pause_generation`` waits 20 ms)."""
    drain_s: float = 0.0
    """Reading the front end's backlog for the version marks (streamed labels only; no wait)."""
    install_s: float = 0.0
    """The workers' install (reload, direct load or copy plan)."""
    label_s: float = 0.0
    """Setting the engine's version label (engine-side labels only)."""
    resume_s: float = 0.0
    """Asking the engine core to resume."""
    paused_s: float = 0.0
    """Generation paused, from the pause request to the resume's answer."""
    prefix_reset_s: float = 0.0
    """Resetting the prefix cache (after the resume unless :attr:`PauseSettings.prefix_reset_inside`)."""
    total_s: float = 0.0
    """The whole install call, checks included."""


@dataclass
class PauseSettings:
    """How an install pauses; the defaults keep in the pause only what the version labels need."""

    settle_s: float = 0.0
    """Seconds to wait after the pause before draining the front end (vLLM's ``pause_generation`` ends with a
    fixed 0.02 s; the drain makes it unnecessary: ``bench/gpu_smoke.py`` measures both)."""
    prefix_reset_inside: bool = False
    """Reset the prefix cache inside the pause (as vLLM's own weight-update flow does) instead of after it."""


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
    """How the last push the workers held was installed (weight group, CUDA IPC): ``reload``, ``direct``,
    ``copy`` or ``checked`` (rollout.install.direct_load)."""
    direct_load_refused: str = ""
    """Why plain ``load_weights`` is not used for this model (empty: proven, or not checked yet)."""
    copy_plan_refused: str = ""
    """Why the copy plan of ``rollout.install.direct_load`` is not used (empty: proven, or not checked yet)."""
    refit_bytes_total: int = 0
    """Bytes of weights installed since the engine started."""
    refit_bytes_last: int = 0
    """Bytes of the last installed push."""
    prefix_cache_reset_deferred: int = 0
    """Installs whose prefix-cache reset was refused (blocks of running requests still in use); new requests are
    salted by version instead."""
    version_drain_incomplete: int = 0
    """Installs whose version marks could not count the front end's backlog (streamed labels on a vLLM without
    the output queue and collectors of rollout.streamed.frontend_backlog): samples the front end was behind on
    have their mark late."""
    drain_complete_last: bool = True
    """The last install counted the front end's backlog into its marks."""
    drain_backlog_last: int = 0
    """Outputs waiting in the front end's queue when the last pause took effect (streamed labels)."""
    drain_pending_tokens_last: int = 0
    """Tokens produced before the last pause that had not reached their samples (counted into the marks)."""
    phases_last: PauseBreakdown = field(default_factory=PauseBreakdown)
    """Where the last install's seconds went."""
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The counters as plain values (``phases_last`` as a dict of seconds by phase)."""
        return {**vars(self), "phases_last": dataclasses.asdict(self.phases_last)}


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
        self.settings = PauseSettings()
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

    def _reject(self, exc: BaseException) -> None:
        self.stats.refit_rejected += 1
        self.stats.last_error = str(exc) if isinstance(exc, WeightUpdateError) else \
            f"{type(exc).__name__}: {exc}"[:500]

    async def install(self, llm: Any, manifest: WeightManifest, buckets: list[WeightBucket], *,
                      reset: bool = False) -> int:
        """Verify and stage a complete push, then install it with ``reload_weights``; returns the new version."""
        expected = self._expected_params()
        async with self._lock:
            started, times = time.perf_counter(), PauseBreakdown()
            try:
                tensors = await asyncio.to_thread(verify_push, manifest, buckets, expected,
                                                  None if reset else self.version)
                times.verify_s = time.perf_counter() - started
                staged = await asyncio.to_thread(stage_push, tensors, manifest.version, self.engine_id)
                times.stage_s = time.perf_counter() - started - times.verify_s
            except WeightUpdateError as exc:
                self._reject(exc)
                raise
            try:
                await self._paused_install(llm, manifest.version, times, lambda: llm.collective_rpc(
                    "inflight_reload_weights", kwargs={"weights_path": str(staged)}))
            finally:
                remove_staged(staged)
            self._record(started, manifest.total_bytes, times)
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
        async def receive() -> WeightManifest:
            encoded = await self._bounded(llm, llm.collective_rpc("inflight_receive_weights"),
                                          "receiving a weight push from the weight group")
            return self._one_manifest(encoded)
        return await self._install_held(llm, receive, "inflight_drop_received", reset, direct_load)

    async def install_ipc(self, llm: Any, manifest: WeightManifest, shares: list, *, reset: bool = False,
                          direct_load: bool = True) -> int:
        """Have the workers map the learner's exported buffers (CUDA IPC ``shares``, one per bucket of
        ``manifest``: :mod:`rollout.install.ipc_receiver`), check them on the device against the manifest's sums, and
        install them; returns the new version. Rejected (old version serving) before the pause if the
        manifest does not fit the model, a buffer is not on this engine's GPU, or a checksum differs."""
        async def receive() -> WeightManifest:
            # Mapped even if the manifest will be refused: a share that is never mapped and let go keeps the
            # learner's buffer counted as in use (torch frees it only once every share's counter is released).
            encoded = await self._bounded(llm, llm.collective_rpc("inflight_map_ipc", args=(encode(manifest), shares)),
                                          "mapping the learner's weight buffers (CUDA IPC)")
            return self._one_manifest(encoded)
        return await self._install_held(llm, receive, "inflight_drop_mapped", reset, direct_load,
                                        install="inflight_install_mapped")

    @staticmethod
    def _one_manifest(encoded: list[bytes]) -> WeightManifest:
        manifests = [decode(e, expect=WeightManifest) for e in encoded]
        if any(m.checksum != manifests[0].checksum for m in manifests):
            raise WeightUpdateError("the workers received different pushes")
        return manifests[0]

    async def _install_held(self, llm: Any, receive: Callable[[], Awaitable[WeightManifest]], drop: str,
                            reset: bool, direct_load: bool, install: str = "inflight_install_received") -> int:
        """Have the workers take a push in (``receive``), check its manifest, and install what they hold
        (``install``); on a rejection they let it go (``drop``)."""
        expected = self._expected_params()
        async with self._lock:
            started, times = time.perf_counter(), PauseBreakdown()
            try:
                manifest = await receive()
                times.receive_s = time.perf_counter() - started
                verify_manifest(manifest, expected, None if reset else self.version)
                times.verify_s = time.perf_counter() - started - times.receive_s
            except Exception as exc:
                self._reject(exc)
                await self._bounded(llm, llm.collective_rpc(drop), "dropping a rejected push")
                if isinstance(exc, WeightUpdateError):
                    raise
                raise WeightUpdateError(f"rollout engine {self.engine_id}: weight push not received: "
                                        f"{self.stats.last_error}") from exc
            installed = await self._paused_install(llm, manifest.version, times, lambda: llm.collective_rpc(
                install, args=(manifest.version, direct_load)))
            self.stats.install_path_last = installed[0]["path"]
            self.stats.direct_load_refused = installed[0]["refused_reason"]
            self.stats.copy_plan_refused = installed[0]["copy_refused_reason"]
            self._record(started, manifest.total_bytes, times)
            return self.version

    def _record(self, started: float, nbytes: int, times: PauseBreakdown) -> None:
        elapsed = time.perf_counter() - started
        times.total_s = elapsed
        self.stats.phases_last = times
        self.stats.refits += 1
        self.stats.refit_seconds_last = elapsed
        self.stats.refit_seconds_total += elapsed
        self.stats.refit_bytes_total += nbytes
        self.stats.refit_bytes_last = nbytes

    async def _paused_install(self, llm: Any, version: int, times: PauseBreakdown,
                              install: Callable[[], Awaitable[Any]]) -> Any:
        """Pause (``pause_mode``), drain the front end (streamed labels), ``await install()`` (the workers load
        their weights), relabel, advance the version, and always resume; then reset the prefix cache. Each step
        is timed into ``times``. Returns what ``install()`` returned."""
        settings, clock = self.settings, _Clock()
        await self._bounded(llm, pause(llm, self.pause_mode, self.recompute_kv_cache_after_weight_updates),
                            "pause_generation before a weight update")
        times.pause_s = clock.lap()
        try:
            if settings.settle_s:
                await asyncio.sleep(settings.settle_s)
                times.settle_s = clock.lap()
            drained = self.labels.drain(llm)  # no await since the pause returned: the backlog is read whole
            times.drain_s = clock.lap()
            self.stats.drain_backlog_last, self.stats.drain_complete_last = drained.backlog, drained.complete
            self.stats.drain_pending_tokens_last = drained.pending_tokens
            if not drained.complete:
                self.stats.version_drain_incomplete += 1
            try:
                installed = await self._bounded(llm, install(), f"reload_weights of v{version}")
                times.install_s = clock.lap()
                self.stats.install_seconds_last = times.install_s
                if settings.prefix_reset_inside:
                    await self._reset_prefix_cache(llm)
                    times.prefix_reset_s = clock.lap()
                await self._bounded(llm, self.labels.set_label(llm, version), "update_weight_version")
                times.label_s = clock.lap()
            except EngineDead:
                raise  # nothing of this engine will serve again: it is restarted, not marked broken
            except Exception as exc:
                # The workers may hold a mix of old and new weights: refuse to sample until a push succeeds.
                self.broken = f"installing v{version} failed: {type(exc).__name__}: {exc}"
                self.stats.refit_rejected += 1
                self.stats.last_error = self.broken
                raise WeightUpdateError(f"rollout engine {self.engine_id}: {self.broken}") from exc
            self.version = version
            self.labels.mark_running(version, drained)  # still paused: marks where each running sample's v began
            self.broken = ""
        finally:
            clock.lap()
            await self._bounded(llm, llm.resume_generation(), "resume_generation after a weight update")
            times.resume_s = clock.lap()
            times.paused_s = clock.since_start()
            self.stats.pause_seconds_last = times.paused_s
        if not settings.prefix_reset_inside:
            await self._reset_prefix_cache(llm)
            times.prefix_reset_s = clock.lap()
        return installed

    async def _reset_prefix_cache(self, llm: Any) -> None:
        if not await self._bounded(llm, llm.reset_prefix_cache(), "reset_prefix_cache"):
            # Blocks of running requests are still in use; new requests are salted by version instead.
            self.stats.prefix_cache_reset_deferred += 1


class _Clock:
    """Laps of one install's steps."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        lap, self.last = now - self.last, now
        return lap

    def since_start(self) -> float:
        return self.last - self.start


async def pause(llm: Any, mode: str, clear_cache: bool) -> None:
    """Pause generation at the end of the engine's current step. ``AsyncLLM.pause_generation`` (vLLM 0.25.1
    and 0.32) asks the engine client to pause and then sleeps a fixed 20 ms so that the front end can deliver
    the outputs produced before the pause; the install drains the front end itself where labels are streamed
    (:meth:`VersionLabels.drain`), so the client is paused directly (``pause_generation`` only where the
    client has no ``pause_scheduler_async``)."""
    core = getattr(llm, "engine_core", None)
    if core is None or not hasattr(core, "pause_scheduler_async"):
        await llm.pause_generation(mode=mode, clear_cache=clear_cache)
        return
    if clear_cache and hasattr(getattr(llm, "renderer", None), "clear_mm_cache_async"):
        await llm.renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)
