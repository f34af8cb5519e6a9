"""Multi-turn episodes: a group's samples played against an environment, token-in/token-out (design §7, issue 18).

Each of the G samples of a group is an episode with its own state: ``reset(task)``, then turns sampled with the
engine's single-request machinery (retries, per-turn seeds, per-token versions) and answered by ``step``. The
sampled ids stay exactly as the engine produced them; the environment's messages are rendered and tokenized once
(:class:`rollout.episodes.chat_turns.ChatTurns`) and appended with loss mask 0. The reset's messages are the group's
prompt (context, like the data's prompt), so every sample of a group must get the same ones. All samples of all
groups run as concurrent coroutines: while one awaits its environment, the others generate. An environment that
fails fails the sample with its reason, never reward 0; an episode cut by ``grpo.max_rollout_turns`` or
``max_model_len`` before the environment is done gets ``truncated_reward`` (finish reason ``"length"``), or
fails when that is None. The engine is reached through :class:`rollout.episodes.turn_sampler.TurnSampler`.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from protocol import PromptRequest, Trajectory
from protocol.loss_mask import masked_fill
from rollout.episodes.chat_turns import ChatTurns
from rollout.episodes.environment import BoundedEnvironment, EnvStep, Message, Turn
from rollout.episodes.turn_sampler import EpisodeCounters, EpisodeLimits, TurnSampler

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
class EpisodeTokens:
    """One sample's tokens so far, sampled turns and environment turns end to end; environment positions hold
    placeholders until :meth:`trajectory`. The engine's episodes and the pool's agent sessions
    (``services.pool.session_episode``) are laid out by it."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_reasons: list[str] = field(default_factory=list)
    routed: np.ndarray | None = None
    """The latest turn's routed experts (rollout/routed_experts.py): its request was the whole episode so far, so
    they cover every position before its last token, environment tokens included; None once a turn had none."""
    routed_every_turn: bool = True

    def add_turn(self, ids: list[int], logprobs: list[float], versions: np.ndarray, finish_reason: str,
                 routed_experts: np.ndarray | None = None) -> None:
        self.routed_every_turn &= routed_experts is not None
        self.routed = routed_experts if self.routed_every_turn else None
        if self.mask and self.mask[-1] == 1:  # no environment tokens since the last turn: one sampled run, one
            self.turn_reasons[-1] = finish_reason  # reason (the protocol's rule), as the later turn ended
        else:
            self.turn_reasons.append(finish_reason)
        self.ids += ids
        self.logprobs += logprobs
        self.versions += [int(v) for v in versions]
        self.mask += [1] * len(ids)

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
                          turn_finish_reasons=list(self.turn_reasons), routed_experts=self.routed)


@dataclass
class PlayedGroup:
    """A group's episodes, played: the group's prompt (the request's, then the opening messages) and one
    trajectory per sample."""

    prompt_ids: list[int]
    trajectories: list[Trajectory]


@dataclass
class _Group:
    """What every episode of one group shares."""

    sampler: TurnSampler
    env: BoundedEnvironment
    chat: ChatTurns
    request: PromptRequest
    limits: EpisodeLimits
    counters: EpisodeCounters
    temperature: float | None


@dataclass
class _Outcome:
    """How one sample ended: its trajectory, and what failed it (for the counters)."""

    trajectory: Trajectory
    by_environment: bool = False
    """The environment failed it (a failed reset or step, differing openings)."""
    by_generation: bool = False
    """A turn could not be sampled (retries exhausted): the engine may have died."""


async def play_group(sampler: TurnSampler, env: BoundedEnvironment, chat: ChatTurns, request: PromptRequest,
                     group_size: int, limits: EpisodeLimits, counters: EpisodeCounters,
                     temperature: float | None = None) -> PlayedGroup:
    """``group_size`` episodes of ``request`` against ``env``, each with its own state; the group's prompt is the
    request's prompt followed by the opening messages of the first sample that reset (all must agree).
    ``chat`` renders the environment's messages; ``counters`` are added to as the episodes run."""
    group = _Group(sampler, env, chat, request, limits, counters, temperature)
    resets = await asyncio.gather(*(_timed(counters, env.reset(dict(request.task))) for _ in range(group_size)))
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
        return await _play(group, prompt, i, got[0])

    outcomes = await asyncio.gather(*(one(i, got) for i, got in enumerate(resets)))
    if any(o.by_generation for o in outcomes):
        sampler.check_alive(request.prompt_id)
    for o in outcomes:
        counters.episodes += 1
        counters.samples_ok += int(o.trajectory.ok)
        counters.samples_failed += int(not o.trajectory.ok)
        counters.env_failures += int(o.by_environment)
    return PlayedGroup(prompt, [o.trajectory for o in outcomes])


async def _play(group: _Group, prompt: list[int], index: int, state: Any) -> _Outcome:
    """Sample ``index``'s episode after ``prompt``, from the state its reset gave."""
    sampler, chat, env, request, stats = group.sampler, group.chat, group.env, group.request, group.counters
    max_turns, max_len, max_new = group.limits.max_turns, group.limits.max_model_len, group.limits.max_new_tokens
    episode = EpisodeTokens()
    cut = ""
    for turn in range(1, max_turns + 1):
        budget = min(max_new, max_len - len(prompt) - len(episode.ids))
        if budget < 1:  # only before the first turn: an environment turn is appended only with room after it
            return _Outcome(failed_trajectory(sampler.no_room(len(prompt)), "length"))
        got = await sampler.sample_turn(prompt + episode.ids, budget, request.prompt_id, index, turn,
                                        group.temperature)
        if isinstance(got, Exception):
            return _Outcome(failed_trajectory(f"turn {turn}: {got}", "generation"), by_generation=True)
        episode.add_turn(got.token_ids, got.logprobs, got.versions, got.finish_reason, got.routed_experts)
        stats.turns += 1
        stats.tokens_generated += len(got.token_ids)
        final = turn == max_turns or budget < max_new
        step = await _timed(stats, env.step(state, Turn(got.text, tuple(got.token_ids), final=final)))
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
    reward = group.limits.truncated_reward
    if reward is None:
        return _Outcome(failed_trajectory(f"episode truncated: {cut} (truncated_reward is None)", "length"))
    return _Outcome(episode.trajectory(float(reward), "length", {}))


async def _timed(counters: EpisodeCounters, call: Awaitable[T]) -> T:
    """Await an environment call, adding its time to ``env_wait_seconds``."""
    start = time.monotonic()
    try:
        return await call
    finally:
        counters.env_wait_seconds += time.monotonic() - start
