"""Multi-turn episodes: a group's samples played against an environment, token-in/token-out (design §7, issue 18).

Each of the G samples of a group is an episode with its own state: ``reset(task)``, then turns sampled with the
engine's single-request machinery (retries, per-turn seeds, per-token versions) and answered by ``step``. The
sampled ids stay exactly as the engine produced them; the environment's messages are rendered and tokenized once
(:class:`rollout.chat_turns.ChatTurns`) and appended with loss mask 0. The reset's messages are the group's
prompt (context, like the data's prompt), so every sample of a group must get the same ones. All samples of all
groups run as concurrent coroutines: while one awaits its environment, the others generate. An environment that
fails fails the sample with its reason, never reward 0; an episode cut by ``grpo.max_rollout_turns`` or
``max_model_len`` before the environment is done gets ``truncated_reward`` (finish reason ``"length"``), or
fails when that is None.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from protocol import PromptRequest, Trajectory, TrajectoryGroup
from protocol.loss_mask import masked_fill
from rollout.chat_turns import ChatTurns
from rollout.environment import BoundedEnvironment, EnvStep, Message, Turn
from rollout.reward_env import RewardEnv

if TYPE_CHECKING:
    from rollout.sampling import GroupSampler

T = TypeVar("T")
ENV = "environment"
"""The failure kind of a failed reset or step, differing openings, or messages that do not render (a reward
function that fails inside the environment's step is the environment's failure; the reason says ``reward``)."""


def failed_trajectory(reason: str, kind: str) -> Trajectory:
    """A failed sample: no tokens, no reward, ``finish_reason="error"``, its ``reason`` and what failed it
    (``kind``, one of :data:`protocol.FAILURE_KINDS`)."""
    empty = np.zeros(0, np.int32)
    return Trajectory(empty, np.zeros(0, np.float32), empty, None, "error", reason, failure_kind=kind)


@dataclass
class _Episode:
    """One sample's tokens so far; environment positions hold placeholders until :meth:`trajectory`."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_reasons: list[str] = field(default_factory=list)

    def add_turn(self, ids: list[int], logprobs: list[float], versions: np.ndarray, finish_reason: str) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.versions += [int(v) for v in versions]
        self.mask += [1] * len(ids)
        self.turn_reasons.append(finish_reason)

    def add_environment(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [0] * len(ids)
        self.mask += [0] * len(ids)

    def trajectory(self, reward: float, finish_reason: str, components: dict[str, float]) -> Trajectory:
        mask = np.asarray(self.mask, np.uint8)
        lps, versions = masked_fill(mask, np.asarray(self.logprobs, np.float32), np.asarray(self.versions, np.int32))
        return Trajectory(np.asarray(self.ids, np.int32), lps, versions, reward, finish_reason,
                          reward_components=dict(components), loss_mask=mask,
                          turn_finish_reasons=list(self.turn_reasons))


@dataclass
class _Outcome:
    """How one sample ended: its trajectory, and what failed it (for the counters)."""

    trajectory: Trajectory
    by_environment: bool = False
    """The environment failed it (a failed reset or step, differing openings)."""
    by_generation: bool = False
    """A turn could not be sampled (retries exhausted): the engine may have died."""


async def play_group(sampler: GroupSampler, env: BoundedEnvironment, request: PromptRequest, group_size: int,
                     temperature: float | None = None) -> TrajectoryGroup:
    """``group_size`` episodes of ``request`` against ``env``, each with its own state; the group's prompt is the
    request's prompt followed by the opening messages of the first sample that reset (all must agree)."""
    chat = sampler.chat_turns
    if chat is None:
        raise RuntimeError(f"rollout engine {sampler.engine_id}: GroupSampler.chat_turns is not set (the engine "
                           f"sets it at start, from its tokenizer); cannot play episodes")
    resets = await asyncio.gather(*(_timed(sampler, env.reset(dict(request.task))) for _ in range(group_size)))
    prompt = [int(t) for t in request.prompt_ids]
    first, opening, opening_error = 0, None, None
    for i, got in enumerate(resets):
        if not isinstance(got, EnvStep):
            first, opening = i, got[1]
            try:
                prompt = chat.opening(prompt, opening)
            except ValueError as exc:
                opening_error = str(exc)
            break

    async def one(i: int, got: tuple[Any, list[Message]] | EnvStep) -> _Outcome:
        if isinstance(got, EnvStep):
            return _Outcome(failed_trajectory(got.failure or "environment: reset failed", ENV), by_environment=True)
        if got[1] != opening:
            return _Outcome(failed_trajectory(f"a group shares its prompt; reset gave sample {i} a different "
                                              f"opening than sample {first}", ENV), by_environment=True)
        if opening_error is not None:
            return _Outcome(failed_trajectory(opening_error, ENV))
        return await _play(sampler, chat, env, request, prompt, i, got[0], temperature)

    outcomes = await asyncio.gather(*(one(i, got) for i, got in enumerate(resets)))
    if any(o.by_generation for o in outcomes):
        sampler.check_alive(request.prompt_id)
    stats = sampler.stats
    for o in outcomes:
        stats.episodes += 1
        stats.samples_ok += int(o.trajectory.ok)
        stats.samples_failed += int(not o.trajectory.ok)
        stats.env_failures += int(o.by_environment)
    if isinstance(sampler.reward_fn, RewardEnv):  # the environment may score its final answers with it
        stats.reward_timeouts = sampler.reward_fn.workers.timeouts
    return sampler.finish_group(request, prompt, [o.trajectory for o in outcomes], group_size)


async def _play(sampler: GroupSampler, chat: ChatTurns, env: BoundedEnvironment, request: PromptRequest,
                prompt: list[int], index: int, state: Any, temperature: float | None) -> _Outcome:
    """Sample ``index``'s episode after ``prompt``, from the state its reset gave."""
    stats, max_turns, max_len = sampler.stats, sampler.max_turns, sampler.max_model_len
    max_new = sampler.generation.max_new_tokens
    episode = _Episode()
    cut = ""
    for turn in range(1, max_turns + 1):
        budget = min(max_new, max_len - len(prompt) - len(episode.ids))
        if budget < 1:  # only before the first turn: an environment turn is appended only with room after it
            return _Outcome(failed_trajectory(sampler.no_room(len(prompt)), "length"))
        got = await sampler.sample_turn(prompt + episode.ids, budget, request.prompt_id, index, turn, temperature)
        if isinstance(got, Exception):
            return _Outcome(failed_trajectory(f"turn {turn}: {got}", "generation"), by_generation=True)
        episode.add_turn(got.token_ids, got.logprobs, got.versions, got.finish_reason)
        stats.turns += 1
        stats.tokens_generated += len(got.token_ids)
        final = turn == max_turns or budget < max_new
        step = await _timed(sampler, env.step(state, Turn(got.text, tuple(got.token_ids), final=final)))
        if step.failure is not None:
            return _Outcome(failed_trajectory(step.failure, ENV), by_environment=True)
        if step.done:
            assert step.reward is not None  # EnvStep guarantees it for a done step that did not fail
            return _Outcome(episode.trajectory(step.reward, got.finish_reason, step.components))
        if turn == max_turns:
            cut = f"the environment was not done after grpo.max_rollout_turns={max_turns} turns"
            break
        try:
            env_ids = chat.after_turn(got.token_ids, step.observation)
        except ValueError as exc:
            return _Outcome(failed_trajectory(str(exc), ENV))
        used = len(prompt) + len(episode.ids)
        if used + len(env_ids) + 1 > max_len:
            cut = (f"the environment was not done after {turn} turns and its next message ({len(env_ids)} tokens "
                   f"after {used}) leaves no room for another turn within max_model_len={max_len}")
            break
        episode.add_environment(env_ids)
        stats.env_tokens += len(env_ids)
    stats.episodes_truncated += 1
    reward = sampler.truncated_reward
    if reward is None:
        return _Outcome(failed_trajectory(f"episode truncated: {cut} (truncated_reward is None)", "length"))
    return _Outcome(episode.trajectory(float(reward), "length", {}))


async def _timed(sampler: GroupSampler, call: Awaitable[T]) -> T:
    """Await an environment call, adding its time to ``env_wait_seconds``."""
    start = time.monotonic()
    try:
        return await call
    finally:
        sampler.stats.env_wait_seconds += time.monotonic() - start
