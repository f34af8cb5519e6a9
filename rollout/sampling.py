"""Group sampling on a started vLLM engine: G independent requests per prompt, retries, scoring.

A group of G answers is G requests (``n=1``), each with its own request id,
deadline, abort, retry and seed (engine seed, prompt id, sample index, attempt).
A failed attempt (timeout, vLLM abort, error) is retried up to
``generation.max_retries`` times; a sample that still fails, or that the
reward function cannot score, is returned with ``finish_reason="error"`` and
``reward=None``, never with reward 0. docs/rollout.md ("Groups") has the rules.
With an ``environment`` set, each sample is a multi-turn episode instead (:mod:`rollout.episodes.episode`), which
reaches this sampler only through :class:`rollout.episodes.turn_sampler.TurnSampler`.
"""
from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol import PromptRequest, Trajectory, TrajectoryGroup
from protocol.images import PromptImage
from rollout import routed_experts
from rollout.config import GenerationConfig
from rollout.episodes.chat_turns import ChatTurns
from rollout.episodes.environment import BoundedEnvironment
from rollout.episodes.episode import failed_trajectory, play_group
from rollout.episodes.turn_sampler import EpisodeLimits, SampledTurn
from rollout.errors import EngineError
from rollout.labels import VersionLabels
from rollout.liveness import EngineDead
from rollout.rewards.registry import RewardFailure, RewardFn, RewardInput
from rollout.rewards.reward_env import RewardEnv, score_samples
from rollout.streamed import StreamedSample
from rollout.vllm_images import ImageTokens, vllm_prompt

REWARD_WORKERS = 4
"""Threads that run plain (non-async) reward functions; a hung one keeps its thread until it returns."""


class SampleFailed(Exception):
    """One sample attempt failed; the message is the reason reported if retries run out, ``kind`` what failed it
    (``"generation"``, or ``"length"``: no room for the prompt; :data:`protocol.FAILURE_KINDS`)."""

    def __init__(self, reason: str, kind: str = "generation"):
        super().__init__(reason)
        self.kind = kind


@dataclass
class SamplingStats:
    """Sampling counters since the engine started; ``RolloutEngine.stats()`` reports them with the install
    counters (:class:`rollout.install.installer.InstallStats`)."""

    groups: int = 0
    """Groups finished (every sample scored or failed)."""
    samples_ok: int = 0
    """Samples generated and scored."""
    samples_failed: int = 0
    """Samples returned with ``finish_reason="error"`` (retries exhausted, or not scorable)."""
    tokens_generated: int = 0
    """Response tokens sampled, over all attempts."""
    requests_running: int = 0
    """Requests in the engine now."""
    attempts_failed: int = 0
    """Attempts that failed (each is retried until ``max_retries``)."""
    retries: int = 0
    """Attempts made again after a failed one."""
    aborts: int = 0
    """Attempts past their deadline, aborted in the engine."""
    reward_failures: int = 0
    """Samples whose reward could not be computed (they fail, never score 0)."""
    reward_timeouts: int = 0
    """Reward calls killed at ``env.<name>.timeout_s`` in a named environment's worker processes."""
    episodes: int = 0
    """Samples played as environment episodes (every sample of a group, when ``environment`` is set)."""
    turns: int = 0
    """Turns sampled in episodes."""
    env_tokens: int = 0
    """Environment tokens appended to episodes (loss mask 0)."""
    env_failures: int = 0
    """Samples failed by the environment (a failed reset or step, or a group's differing openings)."""
    episodes_truncated: int = 0
    """Episodes ended by ``grpo.max_rollout_turns`` or ``max_model_len`` before the environment was done."""
    env_wait_seconds: float = 0.0
    """Time spent awaiting the environment's ``reset`` / ``step``, summed over samples (they overlap)."""


class GroupSampler:
    """Samples and scores groups; ``generation``, ``reward_fn``, ``reward_timeout_s``, ``environment``,
    ``max_turns`` and ``truncated_reward`` are read at every call. It is the
    :class:`~rollout.episodes.turn_sampler.TurnSampler` of the episodes it plays."""

    def __init__(self, engine_id: str, generation: GenerationConfig, reward_fn: RewardFn, reward_timeout_s: float,
                 labels: VersionLabels, max_model_len: int, llm: Callable[[], Any], version: Callable[[], int],
                 dead_reason: Callable[[], str], environment: BoundedEnvironment | None = None,
                 max_turns: int = 1, truncated_reward: float | None = 0.0):
        self.engine_id = engine_id
        self.max_model_len = max_model_len
        """Prompt + answer tokens of one sequence: an answer gets ``min(max_new_tokens, max_model_len - prompt)``."""
        self.generation = generation
        self.reward_fn = reward_fn
        self.reward_timeout_s = reward_timeout_s
        self.labels = labels
        self.environment = environment
        """Plays each sample as a multi-turn episode (:mod:`rollout.episodes.episode`); None: one answer scored by
        ``reward_fn``."""
        self.max_turns = max_turns
        """``grpo.max_rollout_turns``: the most turns an episode samples."""
        self.truncated_reward = truncated_reward
        """The reward of an episode cut by ``max_turns`` or ``max_model_len`` before the environment was done
        (its finish reason is ``"length"``); None: such an episode fails."""
        self.chat_turns: ChatTurns | None = None
        """Renders and tokenizes environment messages (set at engine start, from the engine's tokenizer)."""
        self.text_of: Callable[[list[int]], str] | None = None
        """Decodes a finished answer's tokens once (set at engine start, from the engine's tokenizer), so vLLM's
        front end need not detokenize every token and its log-prob as it samples; None, or with stop strings
        (vLLM matches them on the text), vLLM detokenizes."""
        self._llm = llm
        """The started engine (raises if it is not started or has died)."""
        self._version = version
        """The version being served now (labels a new request and salts its prefix cache)."""
        self._dead_reason = dead_reason
        self.stats = SamplingStats()
        self.vocab_size = 0
        self.image_token_id: ImageTokens | int | None = None
        """A vision-language model's image placeholder tokens (set at engine start); None: a text model."""
        self._moe_layers: tuple[int, ...] | None = None
        """The model's MoE layers (from the engine's HF config, at the first routed output)."""
        self._request_ids = itertools.count()
        self._reward_pool = ThreadPoolExecutor(REWARD_WORKERS, thread_name_prefix=f"reward-{engine_id}")

    def shutdown(self) -> None:
        self._reward_pool.shutdown(wait=False, cancel_futures=True)
        if isinstance(self.reward_fn, RewardEnv):
            self.reward_fn.close()  # its worker processes

    async def group(self, request: PromptRequest, group_size: int,
                    temperature: float | None = None) -> TrajectoryGroup:
        """Sample ``group_size`` answers to ``request``, score them, and return the group; ``temperature``
        overrides ``generation.temperature`` (validation; 0 is greedy). With an ``environment``, each sample is an
        episode (:func:`rollout.episodes.episode.play_group`)."""
        if self.environment is not None:
            if request.images:
                raise ValueError(f"prompt {request.prompt_id}: images with an environment (multi-turn episodes) "
                                 f"are not supported")
            return await self._play_episodes(self.environment, request, group_size, temperature)
        results = await asyncio.gather(*(self._sample_with_retries(request, i, temperature)
                                         for i in range(group_size)))
        if any(isinstance(r, SampleFailed) for r in results):
            self.check_alive(request.prompt_id)
        done = [(i, r) for i, r in enumerate(results) if isinstance(r, SampledTurn)]
        scores = await score_samples(self.reward_fn, [RewardInput(s.text, list(s.token_ids), dict(request.task))
                                                      for _, s in done],
                                     self.reward_timeout_s, self._reward_pool)
        if isinstance(self.reward_fn, RewardEnv):
            self.stats.reward_timeouts = self.reward_fn.workers.timeouts
        trajectories: list[Trajectory] = []
        score_of = {i: score for (i, _), score in zip(done, scores, strict=True)}
        for i, result in enumerate(results):
            if isinstance(result, SampleFailed):
                trajectories.append(failed_trajectory(str(result), result.kind))
                self.stats.samples_failed += 1
            elif isinstance(score := score_of[i], RewardFailure):
                trajectories.append(failed_trajectory(f"reward: {score.reason}", "reward"))
                self.stats.samples_failed += 1
                self.stats.reward_failures += 1
            else:
                trajectories.append(Trajectory(np.asarray(result.token_ids), np.asarray(result.logprobs),
                                               result.versions, score.reward, result.finish_reason,
                                               reward_components=dict(score.components),
                                               routed_experts=result.routed_experts))
                self.stats.samples_ok += 1
                self.stats.tokens_generated += len(result.token_ids)
        return self.finish_group(request, request.prompt_ids, trajectories, group_size)

    async def _play_episodes(self, env: BoundedEnvironment, request: PromptRequest, group_size: int,
                             temperature: float | None) -> TrajectoryGroup:
        """Each sample an episode against ``env`` (:func:`rollout.episodes.episode.play_group`), with this
        sampler's limits as they are now, counted in :attr:`stats`."""
        if self.chat_turns is None:
            raise RuntimeError(f"rollout engine {self.engine_id}: GroupSampler.chat_turns is not set (the engine "
                               f"sets it at start, from its tokenizer); cannot play episodes")
        limits = EpisodeLimits(self.max_turns, self.max_model_len, self.generation.max_new_tokens,
                               self.truncated_reward)
        played = await play_group(self, env, self.chat_turns, request, group_size, limits, self.stats, temperature)
        if isinstance(self.reward_fn, RewardEnv):  # the environment may score its final answers with it
            self.stats.reward_timeouts = self.reward_fn.workers.timeouts
        return self.finish_group(request, played.prompt_ids, played.trajectories, group_size)

    def finish_group(self, request: PromptRequest, prompt_ids: np.ndarray | list[int],
                     trajectories: list[Trajectory], group_size: int) -> TrajectoryGroup:
        """Count the group and wrap its ``trajectories``, sampled after ``prompt_ids``."""
        self.stats.groups += 1
        return TrajectoryGroup(group_id=f"{self.engine_id}:{request.prompt_id}:{self.stats.groups}",
                               prompt_id=request.prompt_id, prompt_ids=np.asarray(prompt_ids),
                               trajectories=trajectories, group_size=group_size, vocab_size=self.vocab_size,
                               scheduled_step=request.scheduled_step, engine_id=self.engine_id,
                               created_at=time.time(), image_ids=tuple(i.sha256 for i in request.images))

    def no_room(self, prompt_len: int) -> str:
        """Why a prompt of ``prompt_len`` tokens cannot be answered: it fills ``max_model_len``."""
        return f"prompt of {prompt_len} tokens leaves no room for an answer (max_model_len {self.max_model_len})"

    def check_alive(self, prompt_id: str) -> None:
        """After a sample failed: :class:`EngineDead` if the engine itself has died (the group is not returned)."""
        if reason := self._dead_reason():
            raise EngineDead(f"rollout engine {self.engine_id}: {reason} (prompt {prompt_id})")

    async def sample_turn(self, token_ids: list[int], budget: int, prompt_id: str, index: int, turn: int,
                          temperature: float | None = None) -> SampledTurn | SampleFailed:
        """Turn ``turn`` of sample ``index``: at most ``budget`` tokens after ``token_ids`` (the prompt and the
        episode so far), retried like a single-turn sample; each attempt's seed is made from (engine seed,
        ``prompt_id``, ``index``, ``turn``, attempt). The failure, once retries run out, is returned."""
        async def attempt(n: int) -> SampledTurn:
            seed = zlib.crc32(f"{self.generation.vllm_cfg.seed}:{prompt_id}:{index}:{turn}:{n}".encode())
            return await self._generate(token_ids, budget, seed, temperature)
        return await self._retrying(attempt)

    async def logprobs_of(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                          images: list[list[PromptImage]] | None = None) -> list[np.ndarray]:
        """The engine's log-prob of each response token given its prompt (and its ``images``) and the tokens
        before it."""
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"logprobs_of: {len(prompt_ids)} prompts but {len(response_ids)} responses")
        pictures = images if images is not None else [[] for _ in prompt_ids]

        async def one(prompt: list[int], response: list[int], pics: list[PromptImage]) -> np.ndarray:
            if not prompt:
                raise ValueError("logprobs_of: a prompt must have at least one token")
            params = self._sampling_params(0, max_tokens=1, prompt_logprobs=0)
            tokens = list(prompt) + list(response)
            try:
                out = await self._run_request(tokens, params, self.generation.request_timeout_s, images=pics)
            except SampleFailed as exc:
                raise EngineError(f"rollout engine {self.engine_id}: logprobs_of failed: {exc}") from None
            per_pos, first = out.prompt_logprobs, len(out.prompt_token_ids) - len(response)  # image runs collapse
            return np.array([per_pos[first + k][t].logprob for k, t in enumerate(response)], dtype=np.float32)
        return list(await asyncio.gather(*(one(p, r, i) for p, r, i in zip(prompt_ids, response_ids, pictures,
                                                                             strict=True))))

    def _sampling_params(self, seed: int, max_tokens: int | None = None, stream: bool = False,
                         temperature: float | None = None, **extra: Any):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        g = self.generation
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        temperature = g.temperature if temperature is None else temperature
        return SamplingParams(n=1, max_tokens=max_tokens or g.max_new_tokens, temperature=temperature,
                              top_p=g.top_p, top_k=g.top_k or 0, stop=list(g.stop_strings) or None,
                              bad_words=list(g.bad_words) or None, seed=seed, output_kind=kind,
                              detokenize=self._engine_detokenizes(), **extra)

    def _engine_detokenizes(self) -> bool:
        """Whether a request made now has vLLM detokenize (see :attr:`text_of`)."""
        return self.text_of is None or bool(self.generation.stop_strings)

    def _new_request_id(self) -> str:
        return f"{self.engine_id}-{next(self._request_ids)}"

    async def _run_request(self, token_ids: list[int], params: Any, timeout_s: float,
                           streamed: StreamedSample | None = None, request_id: str | None = None,
                           images: Sequence[PromptImage] = ()) -> Any:
        """Run one request (of ``token_ids`` and the prompt's ``images``) to completion within ``timeout_s``; abort
        it in the engine otherwise.

        With ``streamed`` (a DELTA request opened in the labels as ``request_id``) every output is
        appended to it; the request leaves the labels when it ends, whatever the outcome."""
        llm = self._llm()
        request_id = request_id or self._new_request_id()
        version = self._version()
        prompt: Any = vllm_prompt(token_ids, images, version, self.image_token_id)
        final = None
        self.stats.requests_running += 1
        try:
            async with asyncio.timeout(timeout_s):
                async for out in llm.generate(prompt, params, request_id):
                    if streamed is not None:
                        try:
                            streamed.add(out.outputs[0])
                        except ValueError as exc:  # a streamed output without its log-probs
                            raise SampleFailed(str(exc)) from exc
                    final = out
        except TimeoutError:
            self.stats.aborts += 1
            await llm.abort(request_id)
            raise SampleFailed(f"timeout after {timeout_s:g}s (request aborted)") from None
        finally:
            self.stats.requests_running -= 1
            if streamed is not None:
                self.labels.close(request_id)
        if final is None or not final.finished:
            raise SampleFailed("the engine ended the request without a final output")
        return final

    async def _sample_once(self, request: PromptRequest, index: int, attempt: int,
                           temperature: float | None = None) -> SampledTurn:
        seed = zlib.crc32(f"{self.generation.vllm_cfg.seed}:{request.prompt_id}:{index}:{attempt}".encode())
        budget = min(self.generation.max_new_tokens, self.max_model_len - len(request.prompt_ids))
        if budget < 1:
            raise SampleFailed(self.no_room(len(request.prompt_ids)), "length")
        return await self._generate(request.prompt_ids.tolist(), budget, seed, temperature, request.images)

    async def _generate(self, token_ids: list[int], budget: int, seed: int,
                        temperature: float | None = None, images: Sequence[PromptImage] = ()) -> SampledTurn:
        """One attempt: at most ``budget`` tokens after ``token_ids`` (and ``images``), with their log-probs and
        versions."""
        request_id = self._new_request_id()
        streamed = self.labels.open(request_id, self._version())
        params = self._sampling_params(seed, max_tokens=budget, stream=streamed is not None,
                                       temperature=temperature, logprobs=0)
        try:
            out = await self._run_request(token_ids, params, self.generation.request_timeout_s,
                                          streamed, request_id, images)
        except (SampleFailed, EngineDead):
            raise
        except Exception as exc:  # engine errors fail this attempt, with their text
            if reason := self._dead_reason():
                raise EngineDead(f"rollout engine {self.engine_id}: {reason}: {exc!r}") from exc
            raise SampleFailed(f"generation failed: {type(exc).__name__}: {exc}") from exc
        c = out.outputs[0]
        if c.finish_reason not in ("stop", "length"):
            raise SampleFailed(f"generation ended with finish_reason={c.finish_reason!r}")
        if streamed is not None:
            return SampledTurn(streamed.token_ids, streamed.logprobs, streamed.versions(), c.finish_reason,
                               self._text(params, streamed.token_ids, "".join(streamed.text)),
                               self._routing(c, len(token_ids) + len(streamed.token_ids)))
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise SampleFailed(f"engine returned {0 if c.logprobs is None else len(c.logprobs)} log-probs "
                               f"for {len(ids)} tokens")
        lps = [c.logprobs[i][tok].logprob for i, tok in enumerate(ids)]
        try:
            versions = self.labels.span_versions(c, len(ids))
        except ValueError as exc:
            raise SampleFailed(str(exc)) from None
        return SampledTurn(ids, lps, versions, c.finish_reason, self._text(params, ids, c.text),
                           self._routing(c, len(token_ids) + len(ids)))

    def _text(self, params: Any, ids: list[int], engine_text: str) -> str:
        """The answer's text: vLLM's, or decoded here once when the request (``params``) did not detokenize."""
        return engine_text if params.detokenize or self.text_of is None else self.text_of(ids)

    def _routing(self, output: Any, positions: int) -> np.ndarray | None:
        """The output's routed experts cut to the MoE layers (rollout/routed_experts.py); None if it has none."""
        if getattr(output, "routed_experts", None) is None:
            return None
        if self._moe_layers is None:
            self._moe_layers = routed_experts.layers_of(self._llm().model_config.hf_config)
        return routed_experts.trajectory_routing(output, self._moe_layers, positions)

    async def _sample_with_retries(self, request: PromptRequest, index: int,
                                   temperature: float | None = None) -> SampledTurn | SampleFailed:
        return await self._retrying(lambda attempt: self._sample_once(request, index, attempt, temperature))

    async def _retrying(self, attempt_once: Callable[[int], Awaitable[SampledTurn]]) -> SampledTurn | SampleFailed:
        failure = SampleFailed("not attempted")
        for attempt in range(self.generation.max_retries + 1):
            if attempt:
                self.stats.retries += 1
            try:
                return await attempt_once(attempt)
            except SampleFailed as exc:
                self.stats.attempts_failed += 1
                failure = exc
        return SampleFailed(f"{failure} (after {self.generation.max_retries + 1} attempts)", failure.kind)

