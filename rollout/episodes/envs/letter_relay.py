"""Letter relay: a multi-turn game that a random tiny model can learn on CPU in minutes (docs/environments.md,
"Letter relay").

An episode has one round per letter of ``task["letters"]`` (``"i,o,i"``: three rounds). The data prompt names
the first letter ("Repeat the letter i."); the environment's answer to each turn names the next ("Good. Now
repeat the letter o." / "That was not i. Now repeat the letter o."), so the model must read the latest message
to score well. A round's score is ``repeat_letter``'s: the fraction of the turn's token ids in that letter's
token set (``task["target_token_ids_<letter>"]``, comma-separated ids, as ``repeat_letter``'s
``target_token_ids``); the reward is the mean over the rounds, given on the last one -- or on a turn the engine
says is its last (``Turn.final``), where rounds not played score 0. Every token set comes from the task, so the
class never loads a tokenizer (``services.data.tasks`` builds the tasks from ``repeat_targets(tokenizer)``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rollout.episodes.environment import EnvStep, Message, Turn
from rollout.rewards.reward_fns import repeat_letter
from rollout.rewards.reward_types import RewardInput

LETTERS_KEY = "letters"
"""The task key of the rounds' letters, comma-separated (``"i,o,i"``)."""
TOKEN_IDS_KEY = "target_token_ids_{letter}"
"""The task key of one letter's token ids (every token whose text starts with the letter), comma-separated."""
MAX_ROUNDS = 64


def first_prompt(letter: str) -> str:
    """The data prompt's text: it names the first round's letter."""
    return f"Repeat the letter {letter}."


def next_prompt(passed: bool, letter: str, next_letter: str) -> str:
    """The environment's answer to a round (``letter``): whether it passed, and the next round's letter."""
    return f"Good. Now repeat the letter {next_letter}." if passed else \
        f"That was not {letter}. Now repeat the letter {next_letter}."


def relay_task(letters: Sequence[str], token_ids: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """The task of an episode with these rounds' ``letters``; ``token_ids[letter]`` is the letter's token set."""
    task = {LETTERS_KEY: ",".join(letters)}
    for letter in sorted(set(letters)):
        task[TOKEN_IDS_KEY.format(letter=letter)] = ",".join(str(int(i)) for i in token_ids[letter])
    return task


@dataclass
class RelayState:
    """One episode of :class:`LetterRelay`."""

    letters: tuple[str, ...]
    """The rounds' letters, in order."""
    token_ids: dict[str, str]
    """Each letter's token set, comma-separated, as ``repeat_letter`` reads ``target_token_ids``."""
    scores: list[float] = field(default_factory=list)
    """The scores of the rounds played so far."""


class LetterRelay:
    """The letter relay game (module docstring). ``pass_score``: the round score from which the answer says
    "Good." rather than "That was not <letter>." (the reward does not depend on it)."""

    name = "letter_relay"

    def __init__(self, pass_score: float = 0.5):
        if isinstance(pass_score, bool) or not isinstance(pass_score, (int, float)) \
                or not (math.isfinite(pass_score) and 0.0 <= pass_score <= 1.0):
            raise ValueError(f"LetterRelay pass_score: expected a number in [0, 1], got {pass_score!r}")
        self.pass_score = float(pass_score)

    def reset(self, task: dict) -> tuple[RelayState, list[Message]]:
        """The episode of ``task``; no messages: the data prompt names the first letter."""
        return parse_task(task), []

    def step(self, state: RelayState, turn: Turn) -> EnvStep:
        """Score the turn for its round's letter; name the next letter, or end with the mean score."""
        played = len(state.scores)
        if played >= len(state.letters):
            return EnvStep.failed(f"letter_relay: the episode is over ({played} rounds played)")
        if turn.text and not turn.token_ids:
            return EnvStep.failed("letter_relay: the turn has text but no token ids (a round is scored on "
                                  "Turn.token_ids)")
        letter = state.letters[played]
        [score] = repeat_letter([RewardInput(turn.text, turn.token_ids, {"target_token_ids": state.token_ids[letter]})])
        assert isinstance(score, float), score  # the token sets were checked by reset
        state.scores.append(score)
        rounds = len(state.letters)
        if len(state.scores) == rounds or turn.final:  # final: the engine samples no further turn
            info: dict[str, str | float] = {"rounds": rounds, "rounds_played": len(state.scores)}
            info.update({f"round_{i}_score": s for i, s in enumerate(state.scores, 1)})
            return EnvStep.final(sum(state.scores) / rounds, info=info)
        text = next_prompt(score >= self.pass_score, letter, state.letters[played + 1])
        return EnvStep.more([Message("user", text)], {"round": len(state.scores), "round_score": score})


def parse_task(task: Mapping[str, object]) -> RelayState:
    """The episode ``task`` describes; ``ValueError`` naming the key that is missing or malformed."""
    raw = task.get(LETTERS_KEY)
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"letter_relay: task[{LETTERS_KEY!r}] must be comma-separated letters like 'i,o,i', "
                         f"got {raw!r}")
    letters = tuple(x.strip() for x in raw.split(","))
    if not all(len(x) == 1 and x.isalpha() for x in letters):
        raise ValueError(f"letter_relay: task[{LETTERS_KEY!r}] must be comma-separated single letters, got {raw!r}")
    if len(letters) > MAX_ROUNDS:
        raise ValueError(f"letter_relay: task[{LETTERS_KEY!r}] has {len(letters)} rounds, at most {MAX_ROUNDS}")
    token_ids: dict[str, str] = {}
    for letter in sorted(set(letters)):
        key = TOKEN_IDS_KEY.format(letter=letter)
        ids = task.get(key)
        if isinstance(ids, bool) or not isinstance(ids, (str, int)) or not str(ids).strip():
            raise ValueError(f"letter_relay: task[{key!r}] must be the letter's token ids, comma-separated, got "
                             f"{ids!r}")
        try:
            [int(x) for x in str(ids).split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"letter_relay: task[{key!r}] must be comma-separated ints, got {ids!r}") from None
        token_ids[letter] = str(ids)
    return RelayState(letters, token_ids)
