"""Tagged-answer rewards (rollout/rewards/tag_rewards.py): NeMo-RL's format reward and its alphanumeric exact answer."""
from __future__ import annotations

import pytest

from rollout.rewards.reward_types import RewardFailure, RewardInput
from rollout.rewards.registry import REWARD_FNS, get_reward_fn
from rollout.rewards.tag_rewards import exact_alnum, tag_format


def _inputs(*texts: str, task: dict | None = None) -> list[RewardInput]:
    return [RewardInput(t, [], {"answer": "x"} if task is None else task) for t in texts]


@pytest.mark.parametrize("text,want", [
    ("no tags at all", 0.0),
    ("<think>hmm</think> 3", 0.25),
    ("<answer>3</answer>", 0.75),
    ("<think>count</think><answer>3</answer>", 1.0),
    ("<answer>3</answer> then <think>why</think>", 1.0),  # any order
    ("<think>\nline one\nline two\n</think>\n<answer>\nyes\n</answer>", 1.0),  # spans over newlines
    ("<think>open only <answer>3", 0.0),
    ("</think>closed first<think>", 0.0),
    ("<think></think><answer></answer>", 1.0),  # empty spans count
])
def test_tag_format(text, want):
    assert tag_format(_inputs(text)) == [want]


def test_tag_format_scores_each_sample_of_a_batch():
    got = tag_format(_inputs("", "<think>a</think>", "<answer>b</answer>", "<think>a</think><answer>b</answer>"))
    assert got == [0.0, 0.25, 0.75, 1.0]


@pytest.mark.parametrize("text,answer,want", [
    ("<answer>Red</answer>", "red", 1.0),
    ("<answer> red. </answer>", "RED", 1.0),
    ("<think>...</think><answer>Yes!</answer>", "yes", 1.0),
    ("<answer>3</answer>", 3, 1.0),  # a numeric task answer
    ("<answer>small-red circle</answer>", "Small red Circle", 1.0),
    ("<answer>blue</answer>", "red", 0.0),
    ("<answer>reds</answer>", "red", 0.0),
    ("red", "red", 0.0),  # no tags
    ("<think>red</think>", "red", 0.0),
    ("<answer>red", "red", 0.0),
    ("<answer>3</answer>", "<answer> 3 </answer>", 1.0),  # CLEVR-CoGenT's tagged solution column
    ("<answer>3</answer>", "<answer> 4 </answer>", 0.0),
    ("<answer>answer3answer</answer>", "<answer> 3 </answer>", 0.0),
])
def test_exact_alnum(text, answer, want):
    assert exact_alnum(_inputs(text, task={"answer": answer})) == [want]


def test_exact_alnum_without_an_answer_fails_the_sample():
    got = exact_alnum([RewardInput("<answer>red</answer>", [], {"question_type": "x"}),
                       RewardInput("<answer>red</answer>", [], {"answer": "red"})])
    assert isinstance(got[0], RewardFailure) and "answer" in got[0].reason
    assert got[1] == 1.0


def test_registered_by_name():
    assert get_reward_fn("tag_format") is tag_format
    assert get_reward_fn("exact_alnum") is exact_alnum
    assert REWARD_FNS["tag_format"] is tag_format and REWARD_FNS["exact_alnum"] is exact_alnum
