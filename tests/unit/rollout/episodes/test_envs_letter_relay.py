"""The letter relay game played by scripted turns: scores from token ids, the next letter in the answer, the
mean on the last round or on a final turn, and bad tasks refused with the key."""
from __future__ import annotations

import asyncio

import pytest

from rollout.episodes.environment import EnvStep, Turn, as_async
from rollout.episodes.envs.letter_relay import LetterRelay, RelayState, relay_task
from rollout.rewards.reward_fns import repeat_letter
from rollout.rewards.reward_types import RewardInput

IDS = {"a": [10, 11, 12], "b": [20, 21]}
TASK = relay_task(["a", "b", "a"], IDS)


def play(env: LetterRelay, task: dict, turns: list[Turn]):
    state, opening = env.reset(task)
    assert opening == []  # the data prompt names the first letter
    steps = []
    for turn in turns:
        steps.append(env.step(state, turn))
        if steps[-1].done:
            break
    return state, steps


def test_the_task_carries_the_letters_and_each_letters_token_set():
    assert TASK == {"letters": "a,b,a", "target_token_ids_a": "10,11,12", "target_token_ids_b": "20,21"}


def test_a_perfect_player_scores_one_and_hears_the_next_letter():
    state, steps = play(LetterRelay(), TASK, [Turn(" a a", (10, 12)), Turn(" b", (21,)), Turn("a", (11, 11, 10))])
    assert [s.done for s in steps] == [False, False, True]
    assert [m.content for m in steps[0].observation] == ["Good. Now repeat the letter b."]
    assert [m.role for m in steps[0].observation] == ["user"]
    assert steps[1].observation[0].content == "Good. Now repeat the letter a."
    assert steps[0].info == {"round": 1, "round_score": 1.0}
    assert steps[-1].reward == 1.0
    assert steps[-1].info == {"rounds": 3, "rounds_played": 3, "round_1_score": 1.0, "round_2_score": 1.0,
                              "round_3_score": 1.0}
    assert isinstance(state, RelayState) and state.scores == [1.0, 1.0, 1.0]


def test_a_player_that_always_says_the_first_letter_gets_partial_credit():
    turn = Turn(" a a a", (10, 10, 10))
    _, steps = play(LetterRelay(), TASK, [turn, turn, turn])
    assert steps[0].observation[0].content == "Good. Now repeat the letter b."
    assert steps[1].observation[0].content == "That was not b. Now repeat the letter a."
    assert steps[-1].reward == pytest.approx(2 / 3)
    assert steps[-1].info["round_2_score"] == 0.0


def test_rounds_are_scored_on_token_ids_as_repeat_letter_does():
    # the text says "a" but the ids are what count; an id outside both sets dilutes the fraction
    turns = [Turn("a a a a", (10, 99, 99, 99)), Turn("nothing like b", (20, 21, 20, 7)), Turn("", ())]
    _, steps = play(LetterRelay(), TASK, turns)
    assert steps[0].info["round_score"] == 0.25
    assert steps[0].observation[0].content == "That was not a. Now repeat the letter b."
    assert steps[1].info["round_score"] == 0.75
    assert steps[-1].info["round_3_score"] == 0.0  # an empty turn scores 0, as repeat_letter's empty response
    assert steps[-1].reward == pytest.approx((0.25 + 0.75 + 0.0) / 3)
    for turn, letter, step in zip(turns[:2], "ab", steps[:2], strict=True):
        task = {"target_token_ids": TASK[f"target_token_ids_{letter}"]}
        assert [step.info["round_score"]] == repeat_letter([RewardInput(turn.text, turn.token_ids, task)])


def test_pass_score_only_changes_the_words():
    turn = Turn("a", (10, 99))  # half right
    strict, lenient = play(LetterRelay(pass_score=0.9), TASK, [turn])[1], play(LetterRelay(0.5), TASK, [turn])[1]
    assert strict[0].observation[0].content.startswith("That was not a.")
    assert lenient[0].observation[0].content.startswith("Good.")
    assert strict[0].info == lenient[0].info
    with pytest.raises(ValueError, match=r"pass_score: expected a number in \[0, 1\], got 2"):
        LetterRelay(pass_score=2)


def test_a_final_turn_ends_the_episode_with_the_unplayed_rounds_at_zero():
    turn = Turn(" a", (10,))
    final = Turn(" b", (20,), final=True)  # the engine samples no further turn
    _, steps = play(LetterRelay(), TASK, [turn, final, turn])
    assert len(steps) == 2 and steps[-1].done
    assert steps[-1].reward == pytest.approx(2 / 3)
    assert steps[-1].info["rounds_played"] == 2 and "round_3_score" not in steps[-1].info


def test_a_step_after_the_end_or_without_token_ids_fails_with_the_reason():
    env = LetterRelay()
    state, _ = env.reset(relay_task(["a"], IDS))
    assert env.step(state, Turn(" a", (10,))).reward == 1.0
    assert env.step(state, Turn(" a", (10,))).failure == "letter_relay: the episode is over (1 rounds played)"
    state, _ = env.reset(TASK)
    assert "no token ids" in str(env.step(state, Turn(" a a", ())).failure)


@pytest.mark.parametrize("task, words", [
    ({}, "task['letters'] must be comma-separated letters like 'i,o,i', got None"),
    ({"letters": "a,bb"}, "task['letters'] must be comma-separated single letters, got 'a,bb'"),
    ({"letters": "a,b", "target_token_ids_a": "1,2"}, "task['target_token_ids_b'] must be the letter's token ids"),
    ({"letters": "a", "target_token_ids_a": "1,x"}, "task['target_token_ids_a'] must be comma-separated ints"),
    ({"letters": ",".join("a" * 65), "target_token_ids_a": "1"}, "has 65 rounds, at most 64"),
])
def test_a_bad_task_is_refused_naming_the_key(task, words):
    with pytest.raises(ValueError) as err:
        LetterRelay().reset(task)
    assert words in str(err.value)


def test_through_as_async_a_bad_task_fails_the_sample_naming_the_environment():
    env = as_async(LetterRelay(), 5.0, name="relay")

    async def main():
        bad = await env.reset({"letters": "a"})
        started = await env.reset(TASK)
        assert isinstance(started, tuple)
        step = await env.step(started[0], Turn(" a", (10,)))
        return bad, step

    bad, step = asyncio.run(main())
    assert isinstance(bad, EnvStep) and str(bad.failure).startswith(
        "environment 'relay': reset raised ValueError: letter_relay: task['target_token_ids_a']")
    assert not step.done and step.observation[0].content == "Good. Now repeat the letter b."
