"""A rollout session's captured chat calls as one trajectory, token in, token out (issue 38, item 2).

An agent's episode is the calls it made under one ``x-inflight-session`` id (:mod:`services.pool.token_capture`).
Each later call's prompt must begin with the earlier call's prompt and the tokens that call sampled, exactly: what
follows them is the environment's turn (tool results, the user's next message, the chat template's turn markers),
kept as context with loss mask 0. The tokens are laid out by the engine's own
:class:`~rollout.episodes.episode.EpisodeTokens`. An answer the chat template rendered back to other tokens
has been spliced back as sampled by the engine (:mod:`services.pool.session_splice`); an agent that edits its
history (drops a turn, rewrites an answer) breaks the line, and the episode is then refused with the call and the
first position that differ, never re-tokenized.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protocol import FINISH_REASONS, Trajectory
from rollout.episodes.episode import EpisodeTokens
from services.pool.token_capture import CapturedChoice, CapturedCompletion


class SessionBroken(ValueError):
    """The session's calls are not one line of calls that extend each other; the message says where."""


@dataclass(frozen=True)
class SessionEpisode:
    """The session's calls laid end to end: the first call's prompt, then sampled and environment tokens."""

    prompt_ids: list[int]
    trajectory: Trajectory
    calls: int


def session_episode(calls: Sequence[CapturedCompletion], reward: float,
                    group_prompt: Sequence[int] | None = None) -> SessionEpisode:
    """The trajectory of one episode's ``calls`` (in any order: each call's prompt extends the one before, so they
    are ordered by prompt length), scored ``reward``. With ``group_prompt`` (the group's shared prompt), the first
    call's prompt must begin with it and the rest of that prompt is environment context; raises
    :class:`SessionBroken` naming the call and position where the line breaks."""
    if not calls:
        raise SessionBroken("the session made no call")
    ordered = sorted(calls, key=lambda c: len(c.prompt_token_ids))
    choices = [_only_choice(c, k) for k, c in enumerate(ordered)]
    first = list(ordered[0].prompt_token_ids)
    prompt = first if group_prompt is None else list(group_prompt)
    if first[:len(prompt)] != prompt:
        at = _first_difference(prompt, first)
        raise SessionBroken(f"call 0's prompt does not begin with the group's prompt (they differ at token {at})")
    episode = EpisodeTokens()
    seen = list(prompt)  # every token of the episode so far, the prompt included
    for k, (call, choice) in enumerate(zip(ordered, choices, strict=True)):
        now = list(call.prompt_token_ids)
        if k and len(now) == len(ordered[k - 1].prompt_token_ids):
            raise SessionBroken(f"calls {k - 1} and {k} have prompts of the same length ({len(now)} tokens): two "
                                f"answers to one history, not one line of calls")
        if now[:len(seen)] != seen:
            at = _first_difference(seen, now)
            raise SessionBroken(f"call {k}'s prompt does not extend the episode so far: it differs at token {at} of "
                                f"{len(seen)} (an edited history, or an earlier answer rendered back to other tokens)")
        versions = choice.versions()
        if min(versions, default=0) < 0 or any(np.isnan(choice.logprobs)):
            raise SessionBroken(f"call {k}'s answer lacks a policy version or a log-prob for some token (the "
                                f"engine did not label or score it)")
        if now[len(seen):]:
            episode.add_environment(now[len(seen):])
        episode.add_turn(list(choice.token_ids), list(choice.logprobs), np.asarray(versions), choice.finish_reason)
        seen = now + list(choice.token_ids)
    trajectory = episode.trajectory(reward, choices[-1].finish_reason, {})
    return SessionEpisode(prompt, trajectory, len(ordered))


def _only_choice(call: CapturedCompletion, k: int) -> CapturedChoice:
    if len(call.choices) != 1:
        raise SessionBroken(f"call {k} asked for {len(call.choices)} answers; an episode continues one (n=1)")
    (choice,) = call.choices.values()
    if not choice.token_ids:
        raise SessionBroken(f"call {k} sampled no token")
    if choice.finish_reason not in FINISH_REASONS:
        raise SessionBroken(f"call {k}'s answer ended {choice.finish_reason or 'never'!r} (expected one of "
                            f"{FINISH_REASONS})")
    return choice


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
