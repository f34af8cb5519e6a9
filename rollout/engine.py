"""The rollout engine: one vLLM ``AsyncLLM`` that samples scored groups and installs weight pushes in flight.

:class:`RolloutEngine` is the facade the engine actor drives. It owns the
engine's life (start within a bound, sleep / wake-up for colocated mode, shut
down without leaking ``/dev/shm``) and hands the rest to its parts: group
sampling and scoring (:mod:`rollout.sampling`), the install of new weights and
the version it advances (:mod:`rollout.install.installer`), and the per-token version
labels (:mod:`rollout.labels`). docs/rollout.md describes the whole engine.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import gc
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from protocol import PromptRequest, TrajectoryGroup, WeightBucket, WeightManifest
from protocol.images import PromptImage
from rollout import gc_heap, nano_omni
from rollout.completion_order import in_completion_order
from rollout.config import GenerationConfig
from rollout.counters import EnvCounters, RolloutCounters
from rollout.episodes.chat_turns import ChatTurns
from rollout.episodes.environment import BoundedEnvironment
from rollout.errors import EngineError, bounded
from rollout.frontend_yield import yield_between_outputs
from rollout.install.installer import Installer
from rollout.install.weight_receiver import ExpectedParams
from rollout.kv_stats import KvCounters, build_async_llm
from rollout.labels import VersionLabels
from rollout.liveness import EngineDead, EngineProcesses, dead_reason
from rollout.options import EngineOptions, build_engine_options
from rollout.rewards.registry import RewardFn
from rollout.sampling import GroupSampler
from rollout.vllm_images import image_tokens
from rollout.vllm_readback import ReadBack, read_back

__all__ = ["EngineError", "RolloutEngine"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RolloutEngine:
    """One vLLM engine serving a policy version: samples scored groups and installs weight pushes in flight."""

    def __init__(self, model_path: str, generation: GenerationConfig, max_model_len: int,
                 reward_fn: RewardFn, engine_id: str = "0", initial_version: int = 0, *,
                 recompute_kv_cache_after_weight_updates: bool = False, in_flight_weight_updates: bool = True,
                 reward_timeout_s: float = 30.0,
                 start_timeout_s: float = 600.0, weight_update_timeout_s: float = 300.0,
                 environment: BoundedEnvironment | None = None, max_rollout_turns: int = 1,
                 truncated_reward: float | None = 0.0, chat_template_kwargs: Mapping[str, Any] | None = None):
        if max_model_len < 16:
            raise ValueError(f"max_model_len: expected >= 16, got {max_model_len}")
        if generation.max_new_tokens > max_model_len:
            raise ValueError(f"policy.generation.max_new_tokens ({generation.max_new_tokens}) must be <= "
                             f"max_model_len ({max_model_len})")
        if isinstance(max_rollout_turns, bool) or not isinstance(max_rollout_turns, int) or max_rollout_turns < 1:
            raise ValueError(f"grpo.max_rollout_turns: expected an int >= 1, got {max_rollout_turns!r}")
        if truncated_reward is not None and not np.isfinite(truncated_reward):
            raise ValueError(f"truncated_reward: expected a finite number or None, got {truncated_reward!r}")
        if initial_version < 0:
            raise ValueError(f"initial_version: expected >= 0, got {initial_version}")
        for name, value in (("reward_timeout_s", reward_timeout_s), ("start_timeout_s", start_timeout_s),
                            ("weight_update_timeout_s", weight_update_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name}: expected > 0, got {value}")
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.engine_id = engine_id
        self.start_timeout_s = start_timeout_s
        self.weight_update_timeout_s = weight_update_timeout_s
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        """``policy.tokenizer.chat_template_kwargs``: environment turns are rendered with them, as the prompts."""
        self._llm: Any = None
        self._tokenizer: Any = None
        self._gc_frozen = False  # this engine's start froze the process's heap (rollout/gc_heap.py)
        self.read_back: list[ReadBack] = []
        """The ``vllm_kwargs`` entries against the started engine's own config (:mod:`rollout.vllm_readback`)."""
        self._options: EngineOptions | None = None
        self._kv = KvCounters()
        self._procs = EngineProcesses({}, set())
        self._sleeps_skipped_on_cpu = 0
        self.labels = VersionLabels()
        self.installer = Installer(engine_id, self.labels, initial_version,
                                    recompute_kv=recompute_kv_cache_after_weight_updates,
                                    in_flight=in_flight_weight_updates, timeout_s=weight_update_timeout_s)
        self.sampler = GroupSampler(engine_id, generation, reward_fn, reward_timeout_s, self.labels, max_model_len,
                                     llm=self._require_started, version=lambda: self.installer.version,
                                     dead_reason=self.dead_reason, environment=environment,
                                     max_turns=max_rollout_turns, truncated_reward=truncated_reward)

    # ------------------------------------------------------------------ settings read at every call
    # The parts hold the settings that may change between calls: ``sampler.generation``, ``sampler.reward_fn``,
    # ``sampler.reward_timeout_s``, ``sampler.environment``, ``sampler.max_turns``, ``sampler.truncated_reward``,
    # ``installer.recompute_kv_cache_after_weight_updates``, ``labels.streamed``.
    @property
    def generation(self) -> GenerationConfig:
        """Sampling settings; read at every request, so changes apply to the next one."""
        return self.sampler.generation

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Build the ``AsyncLLM`` (bounded by ``start_timeout_s``) and label its outputs with the version."""
        if self._llm is not None:
            raise EngineError(f"rollout engine {self.engine_id}: start() called twice")
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.labels.detect(self.engine_id)
        options = build_engine_options(self.generation.vllm_cfg, self.model_path, self.max_model_len,
                                       colocated=self.generation.colocated.enabled,
                                       kwargs=self.generation.vllm_kwargs, tempered=self.generation.tempered)
        self._options = options
        for line in options.describe():
            logger.info("rollout engine %s: %s", self.engine_id, line)
        for ignored in options.ignored:
            logger.warning("rollout engine %s: %s", self.engine_id, ignored.message(options.platform))
        os.environ.update(options.env)
        if nano_omni.is_nano_omni(self.model_path):  # vLLM's plugins reach only an installed Inflight (its entry
            nano_omni.patch_vllm()  # point); the GPU hosts run it from the source tree, and the image processor
            # runs here, in this process (rollout/nano_omni.py, fix 5)
        self.installer.expected = ExpectedParams.from_model_dir(self.model_path)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.sampler.chat_turns = ChatTurns(self._tokenizer, template_kwargs=self.chat_template_kwargs)
        self.sampler.text_of = functools.partial(answer_text, self._tokenizer)
        engine_args = AsyncEngineArgs(**options.engine_args)
        children_before = EngineProcesses.before_start()
        build = asyncio.get_running_loop().run_in_executor(None, build_async_llm, engine_args, self._kv)
        done, _ = await asyncio.wait({build}, timeout=self.start_timeout_s)
        if not done:
            build.add_done_callback(_shutdown_late_engine)
            raise EngineError(f"rollout engine {self.engine_id}: vLLM did not start within "
                              f"{self.start_timeout_s:g}s ({self.model_path})")
        self._llm = build.result()
        if not yield_between_outputs(self._llm):
            logger.warning("rollout engine %s: this vLLM's front end cannot be made to yield between outputs "
                           "(rollout/frontend_yield.py); a push may wait while it catches up", self.engine_id)
        self._procs = EngineProcesses.started_since(children_before)
        del build, done  # the only owner of the engine is self._llm, so shutdown() really frees it
        self.read_back = read_back(self._llm.vllm_config,
                                   {k: options.engine_args[k] for k in options.applied_kwargs})
        for entry in self.read_back:
            (logger.info if entry.holds else logger.warning)("rollout engine %s: %s", self.engine_id, entry.line())
        self.sampler.vocab_size = int(self._llm.model_config.get_vocab_size())
        self.sampler.image_token_id = image_tokens(self.model_path)
        await self._bounded(self.labels.set_label(self._llm, self.version), "setting the initial weight version")
        frozen, self._gc_frozen = gc_heap.engine_started(), True  # full collections skip vLLM's heap (gc_heap.py)
        logger.info("rollout engine %s: %d objects frozen out of the garbage collector's full passes",
                    self.engine_id, frozen)

    async def shutdown(self) -> None:
        """Shut the engine core and its workers down (frees their /dev/shm segments)."""
        llm, self._llm = self._llm, None
        self.sampler.shutdown()
        if llm is not None:
            # Stop AsyncLLM's output loop first, or it reports the engine core's exit as an engine failure.
            handler = getattr(llm, "output_handler", None)
            if handler is not None:
                handler.cancel()
            await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
            del llm
            if self._gc_frozen:  # thawed, then collected
                self._gc_frozen = False
                gc_heap.engine_stopped()
            else:
                gc.collect()  # run AsyncLLM.__del__ now, not at interpreter exit
        if freed := self._procs.release_leftovers():  # a core that died could not remove its segments
            logger.warning("rollout engine %s: removed %s left by its dead vLLM processes", self.engine_id, freed)

    async def sleep(self) -> None:
        """Release accelerator memory for a colocated learner (vLLM sleep level 1); no-op on CPU."""
        llm = self._require_started()
        if self.options.platform == "cpu":
            self._sleeps_skipped_on_cpu += 1
            return
        await self._bounded(llm.sleep(level=1), "sleep")

    async def wake_up(self) -> None:
        """Take the memory back after :meth:`sleep`; no-op on CPU."""
        llm = self._require_started()
        if self.options.platform == "cpu":
            return
        await self._bounded(llm.wake_up(), "wake_up")

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int:
        """The policy version being served."""
        return self.installer.version

    @property
    def vocab_size(self) -> int:
        self._require_started()
        return self.sampler.vocab_size

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer."""
        self._require_started()
        return self._tokenizer

    def async_llm(self) -> Any:
        """The running vLLM ``AsyncLLM`` (for serving OpenAI requests on the same engine)."""
        return self._require_started()

    @property
    def options(self) -> EngineOptions:
        """The engine options applied and ignored at start."""
        self._require_started()
        assert self._options is not None  # set before the engine is built
        return self._options

    def stats(self) -> dict:
        """Counters: groups, samples, tokens, running requests, retries, aborts, episodes (turns, environment
        tokens, failures, truncations, time awaiting the environment), installs and their cost, and vLLM's
        preemptions / re-prefilled tokens / sampled tokens and unfinished requests (:mod:`rollout.kv_stats`); the
        flat dict of :meth:`counters`."""
        return self.counters().as_dict()

    def counters(self) -> RolloutCounters:
        """The counters now, typed (:class:`rollout.counters.RolloutCounters`; copies, not the live ones)."""
        env = self.sampler.environment
        return RolloutCounters(
            engine_id=self.engine_id, version=self.version, sampling=copy.deepcopy(self.sampler.stats),
            installs=copy.deepcopy(self.installer.stats), kv=copy.deepcopy(self._kv),
            sleeps_skipped_on_cpu=self._sleeps_skipped_on_cpu, weights_broken=self.installer.broken,
            # the output processor's count: vLLM 0.25.1's AsyncLLM has no get_num_unfinished_requests
            vllm_unfinished_requests=(self._llm.output_processor.get_num_unfinished_requests()
                                      if self._llm is not None else 0),
            env=None if env is None else self._env_counters(env))

    def _env_counters(self, env: Any) -> EnvCounters:
        """The environment's counters for the pool's metrics: the episode counters, and for a server its calls
        by outcome (:class:`rollout.episodes.env_http.EnvCallStats`) and retries."""
        s = self.sampler.stats
        counters = EnvCounters(env.name, episodes=s.episodes, env_failures=s.env_failures,
                               env_wait_seconds=s.env_wait_seconds, turns=s.turns, env_tokens=s.env_tokens,
                               episodes_truncated=s.episodes_truncated)
        calls = getattr(env.env, "stats", None)
        if calls is None or not hasattr(calls, "retries"):
            return counters
        outcomes = ("ok", "failed_step", "timeout", "http_5xx", "http_4xx", "malformed", "connection")
        return replace(counters, calls={o: int(getattr(calls, o)) for o in outcomes}, retries=int(calls.retries))

    def dead_reason(self) -> str:
        """Why the started vLLM engine cannot serve any more (:mod:`rollout.liveness`); '' while it can."""
        return dead_reason(self._llm) if self._llm is not None else ""

    # ------------------------------------------------------------------ sampling
    async def generate_group(self, request: PromptRequest, group_size: int,
                             temperature: float | None = None) -> TrajectoryGroup:
        """Sample ``group_size`` answers to ``request``, score them, and return the group; ``temperature``
        overrides ``generation.temperature`` (0: greedy). With an ``environment``, each answer is an episode of
        up to ``max_rollout_turns`` turns (:mod:`rollout.episodes.episode`)."""
        if group_size < 1:
            raise ValueError(f"group_size: expected >= 1, got {group_size}")
        self._require_started()
        self.installer.require_consistent()
        return await self.sampler.group(request, group_size, temperature)

    async def generate(self, requests: list[PromptRequest], group_size: int) -> AsyncIterator[TrajectoryGroup]:
        """Generate a group per request concurrently; yield each group as soon as it is complete."""
        async for group in in_completion_order(self.generate_group(r, group_size) for r in requests):
            yield group

    async def evaluate(self, requests: list[PromptRequest], group_size: int,
                       temperature: float) -> list[TrajectoryGroup | BaseException]:
        """Validation: a scored group per request at ``temperature`` (0: greedy), concurrently with whatever
        else the engine runs; each request's group, or the exception that stopped it, in request order."""
        return list(await asyncio.gather(*(self.generate_group(r, group_size, temperature) for r in requests),
                                         return_exceptions=True))

    async def logprobs_of(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                          images: list[list[PromptImage]] | None = None) -> list[np.ndarray]:
        """The engine's log-prob of each response token given its prompt (and its ``images``) and the tokens
        before it."""
        return await self.sampler.logprobs_of(prompt_ids, response_ids, images)

    # ------------------------------------------------------------------ installs
    async def install(self, manifest: WeightManifest, buckets: list[WeightBucket], *, reset: bool = False) -> int:
        """Install a complete weight push in flight; returns the new version.

        The version must be above the one being served unless ``reset`` (a
        learner attaching to or re-syncing this engine installs its own
        version, whatever it is). Raises :class:`WeightUpdateError` (old
        version still serving) if the push is rejected or cannot be installed."""
        return await self.installer.install(self._require_started(), manifest, buckets, reset=reset)

    @property
    def weight_group_members(self) -> int:
        """Members this engine adds to a weight group: one per vLLM worker."""
        args = self.options.engine_args
        return int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))

    async def join_weight_group(self, host: str, port: int, rank_base: int, world_size: int,
                                timeout_s: float) -> list[int]:
        """Have every worker join the learner's weight group (ranks ``rank_base ..``); returns their ranks.

        Bounded by ``timeout_s`` (the group forms only when every member has joined)."""
        return await self.installer.join_group(self._require_started(), host, port, rank_base, world_size,
                                                timeout_s)

    async def install_from_group(self, *, reset: bool = False) -> int:
        """Receive the next push of the weight group in the workers and install it in flight.

        The transfer runs between two engine steps (generation goes on around it) and is verified on the
        device; the manifest is then checked like :meth:`install` checks a push (version order unless
        ``reset``, every parameter with its shape and dtype), and only then is generation paused for the
        install. Raises :class:`WeightUpdateError` with the old version still serving."""
        return await self.installer.install_from_group(
            self._require_started(), reset=reset, direct_load=self.generation.vllm_cfg.direct_weight_load)

    async def install_ipc(self, manifest: WeightManifest, shares: list, *, reset: bool = False) -> int:
        """Install a push whose buckets stay in the learner's GPU memory: the worker maps them through the CUDA
        IPC ``shares`` (:mod:`rollout.install.ipc_receiver`), checks them on the device against ``manifest`` and
        installs them in flight (copy plan once proven, else ``reload_weights``), reading straight from the
        learner's buffers; the learner may free them once this returns. Checked like :meth:`install_from_group`;
        raises :class:`WeightUpdateError` with the old version still serving."""
        return await self.installer.install_ipc(self._require_started(), manifest, shares, reset=reset,
                                                direct_load=self.generation.vllm_cfg.direct_weight_load)

    async def gpu_uuids(self) -> list[str]:
        """The UUID of each vLLM worker's GPU (empty strings on CPU): an engine whose only GPU is the learner's
        can install its pushes through CUDA IPC."""
        return list(await self._bounded(self._require_started().collective_rpc("inflight_gpu_uuid"),
                                        "asking the workers for their GPU"))

    # ------------------------------------------------------------------ helpers
    async def _bounded(self, awaitable: Awaitable[T], what: str) -> T:
        return await bounded(awaitable, self.weight_update_timeout_s, what, self.engine_id, dead=self.dead_reason)

    def _require_started(self) -> Any:
        if self._llm is None:
            raise EngineError(f"rollout engine {self.engine_id}: not started (call start())")
        if reason := self.dead_reason():
            raise EngineDead(f"rollout engine {self.engine_id}: {reason}")
        return self._llm


def answer_text(tokenizer: Any, token_ids: list[int]) -> str:
    """An answer's text as vLLM's detokenizer gives it: special tokens skipped, and the bytes of a character the
    answer did not finish left out (one decode shows them as U+FFFD)."""
    return tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")


def _shutdown_late_engine(build: asyncio.Future) -> None:
    """Shut down an engine that finished starting after :meth:`RolloutEngine.start` gave up on it."""
    if not build.cancelled() and build.exception() is None:
        build.result().shutdown()
