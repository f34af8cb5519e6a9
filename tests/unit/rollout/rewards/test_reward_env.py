"""Weighted reward environments in pebble worker processes: the weighted sum and per-function values, failures
that fail the sample (never 0), and a hung function killed at its deadline while the pool keeps working."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from rollout.rewards.reward_env import RewardEnv, WeightedReward, reward_labels, score_samples
from rollout.rewards.registry import RewardFailure, RewardInput, Scored

USER_FNS = '''
import time

def hang(batch):
    time.sleep(1000)
    return [1.0] * len(batch)

def half(batch):
    return [0.5] * len(batch)

def boom(batch):
    raise RuntimeError("sympy exploded")
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> str:
    path = Path(tmp_path_factory.mktemp("rewards")) / "user_rewards.py"
    path.write_text(USER_FNS)
    return str(path)


def inp(text: str, **task) -> RewardInput:
    return RewardInput(text, [1, 2], task)


def run(coro):
    return asyncio.run(coro)


def test_weighted_sum_and_components_of_math_verify_and_format():
    env = RewardEnv([WeightedReward("math_verify", 0.8), WeightedReward("format", 0.2)], 2, 20.0, "math")
    try:
        got = run(score_samples(env, [inp("so \\boxed{0.5}", answer="\\frac{1}{2}"), inp("it is 12", answer="12"),
                                      inp("The answer is 13", answer="12"), inp("\\boxed{3}")], 1.0))
    finally:
        env.close()
    assert got[0] == Scored(pytest.approx(1.0), {"math_verify": 1.0, "format": 1.0})
    assert got[1] == Scored(pytest.approx(0.8), {"math_verify": 1.0, "format": 0.0})
    assert got[2] == Scored(pytest.approx(0.2), {"math_verify": 0.0, "format": 1.0})
    assert isinstance(got[3], RewardFailure) and "math_verify: task has no 'answer'" in got[3].reason


def test_a_hung_function_is_killed_at_its_timeout_and_the_pool_keeps_working(user_file):
    env = RewardEnv([WeightedReward(f"{user_file}:hang", 1.0)], 1, 1.0, "slow")
    good = RewardEnv([WeightedReward(f"{user_file}:half", 2.0)], 1, 1.0, "slow")
    good.workers.close()
    good.workers = env.workers  # the same single worker process pool
    try:
        run(score_samples(good, [inp("warm")], 1.0))  # the worker started before the clock below
        t0 = time.monotonic()
        hung = run(score_samples(env, [inp("x")], 1.0))
        took = time.monotonic() - t0
        after = run(score_samples(good, [inp("y")], 1.0))
    finally:
        env.close()
    assert hung == [RewardFailure(f"reward function {user_file}:hang timed out after 1s")]
    assert took < 10
    assert after == [Scored(1.0, {"half": 0.5})]  # the metric name is the function's, not its path
    assert env.workers.timeouts == 1


def test_any_failing_function_fails_the_sample_with_its_reason(user_file):
    env = RewardEnv([WeightedReward("format", 1.0), WeightedReward(f"{user_file}:boom", 1.0)], 1, 20.0)
    try:
        got = run(env.score([inp("\\boxed{1}")]))
        weighted = run(env([inp("\\boxed{1}")]))  # the RewardFn view
    finally:
        env.close()
    assert isinstance(got[0], RewardFailure)
    assert got[0].reason.startswith(f"reward function {user_file}:boom raised RuntimeError: sympy exploded")
    assert isinstance(weighted[0], RewardFailure)


def test_bad_environments_are_clear_errors():
    with pytest.raises(ValueError, match="reward function"):
        RewardEnv([WeightedReward("nope", 1.0)], 1, 1.0, "math")
    with pytest.raises(ValueError, match=r"env.math.reward_functions: weight of 'format'"):
        RewardEnv([WeightedReward("format", 0.0)], 1, 1.0, "math")
    with pytest.raises(ValueError, match="at most once"):
        RewardEnv([WeightedReward("format", 1.0), WeightedReward("format", 2.0)], 1, 1.0, "math")


def test_a_plain_function_keeps_the_legacy_group_path():
    got = run(score_samples(lambda batch: [0.25] * len(batch), [inp("a"), inp("b")], 1.0))
    assert got == [Scored(0.25), Scored(0.25)] and got[0].components == {}


def test_metric_names_of_references_are_the_function_names_made_unique(tmp_path: Path):
    """Issue 33.6: a file-path reward's step-row key was ``reward_/path/to/check_reward.py:check_meta_mean``."""
    names = ["math_verify", "/data/a/check_reward.py:check-meta", "/data/b/check_reward.py:check-meta",
             "pkg.mod:math_verify", "pkg.mod:check_meta"]
    assert reward_labels(names) == {"math_verify": "math_verify", "/data/a/check_reward.py:check-meta": "check_meta",
                                    "/data/b/check_reward.py:check-meta": "check_meta_2",
                                    "pkg.mod:math_verify": "math_verify_2", "pkg.mod:check_meta": "check_meta_3"}
    a, b = tmp_path / "a" / "r.py", tmp_path / "b" / "r.py"
    for f, value in ((a, 0.25), (b, 0.5)):
        f.parent.mkdir()
        f.write_text(f"def check(batch):\n    return [{value}] * len(batch)\n")
    env = RewardEnv([WeightedReward(f"{a}:check", 1.0), WeightedReward(f"{b}:check", 2.0)], 1, 20.0, "two")
    try:
        got = run(env.score([inp("x")]))
    finally:
        env.close()
    assert got == [Scored(1.25, {"check": 0.25, "check_2": 0.5})]
