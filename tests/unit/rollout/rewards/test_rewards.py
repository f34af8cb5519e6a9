"""Reward functions and the bounded scorer: values, per-sample failures, timeouts, bad results."""
from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollout.rewards.registry import (RewardFailure, RewardInput, extract_answer, format_reward, get_reward_fn, math_exact,
                             repeat_letter, score_group)


def inp(text: str = "", ids=(), **task) -> RewardInput:
    return RewardInput(text, list(ids), task)


@pytest.mark.parametrize("text,answer", [
    ("so it is \\boxed{42}", 42.0), ("first 3 then 17", 17.0), ("\\boxed{1,234} but 5", 1234.0),
    ("\\boxed{\\frac{1}{2}} then 9", 2.0), ("x = -3.5", -3.5), ("no digits", None)])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_math_exact_scores_and_reports_bad_tasks_per_sample():
    got = math_exact([inp("The answer is 12", answer=12), inp("\\boxed{13} not 12", answer=12),
                      inp("nothing", answer=12), inp("12"), inp("12", answer="twelve")])
    assert got[:3] == [1.0, 0.0, 0.0]
    assert isinstance(got[3], RewardFailure) and "no 'answer'" in got[3].reason
    assert isinstance(got[4], RewardFailure) and "'twelve'" in got[4].reason


def test_format_reward():
    assert format_reward([inp("so \\boxed{4}"), inp("The answer is 4."), inp("4 is the answer"),
                          inp("\\boxed{4} and more text")]) == [1.0, 1.0, 0.0, 0.0]


def test_repeat_letter_is_fraction_of_target_tokens():
    got = repeat_letter([inp(ids=[7, 7, 7, 7], target_token_id=7), inp(ids=[7, 1, 7, 2], target_token_id=7),
                         inp(ids=[], target_token_id=7), inp(ids=[7], target_token_id="7")])
    assert got[:3] == [1.0, 0.5, 0.0]
    assert isinstance(got[3], RewardFailure) and "target_token_id" in got[3].reason


def test_repeat_letter_counts_every_token_of_the_target_set():
    task = {"target_token_id": 7, "target_token_ids": "7,9,11"}
    got = repeat_letter([RewardInput("", [7, 9, 11, 3], task), RewardInput("", [3, 4], task),
                         RewardInput("", [9], {"target_token_ids": "9,x"})])
    assert got[:2] == [0.75, 0.0]
    assert isinstance(got[2], RewardFailure) and "comma-separated" in got[2].reason


def test_registry():
    assert get_reward_fn("math_exact") is math_exact
    with pytest.raises(ValueError, match=r"reward function: expected one of \['dapo_math_verify', 'exact_alnum', "
                                         r"'format', 'math_exact', 'math_verify', 'repeat_letter', 'tag_format'\] or "
                                         r"'module:function' / "
                                         r"'file.py:function', got 'nope'"):
        get_reward_fn("nope")


def run(coro):
    return asyncio.run(coro)


def test_score_group_awaits_async_and_threads_sync():
    async def async_fn(batch):
        return [2.0] * len(batch)
    assert run(score_group(async_fn, [inp(), inp()], 1.0)) == [2.0, 2.0]
    assert run(score_group(lambda b: [1] * len(b), [inp()], 1.0)) == [1.0]


@pytest.mark.parametrize("fn,reason", [
    (lambda b: 1 / 0, "reward function raised ZeroDivisionError"),
    (lambda b: [1.0], "reward function returned 1 results, expected a list of 2"),
    (lambda b: None, "reward function returned NoneType, expected a list of 2"),
    (lambda b: [math.nan, "x"], None),
])
def test_score_group_turns_errors_into_failures_never_zero(fn, reason):
    got = run(score_group(fn, [inp(), inp()], 1.0))
    assert len(got) == 2 and all(isinstance(r, RewardFailure) for r in got)
    if reason:
        assert all(reason in r.reason for r in got)
    else:
        assert "not finite" in got[0].reason and "not a number" in got[1].reason


def test_score_group_times_out_sync_and_async():
    async def hang(batch):
        await asyncio.sleep(10)

    pool = ThreadPoolExecutor(1)
    try:
        got = run(score_group(hang, [inp()], 0.2)) + run(score_group(lambda b: time.sleep(1.0), [inp()], 0.2, pool))
    finally:
        pool.shutdown(wait=False)
    assert all(isinstance(r, RewardFailure) and "timed out after 0.2s" in r.reason for r in got)


def test_user_reward_functions_by_module_or_file(tmp_path):
    from rollout.rewards.registry import get_reward_fn
    assert get_reward_fn("rollout.rewards.registry:math_exact") is math_exact
    f = tmp_path / "mine.py"
    f.write_text("def score(batch):\n    return [len(s.response_ids) / 10 for s in batch]\n")
    fn = get_reward_fn(f"{f}:score")
    assert fn([inp(ids=[1, 2, 3])]) == [0.3]
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        get_reward_fn(f"{f}:nope")
    with pytest.raises(ValueError, match="cannot import 'no_such_module_x'"):
        get_reward_fn("no_such_module_x:f")
