"""``math_verify`` (Hugging Face Math-Verify) on the forms a math user writes."""
from __future__ import annotations

import pytest

from rollout.rewards.registry import RewardFailure, RewardInput, get_reward_fn, math_verify


def inp(text: str, **task) -> RewardInput:
    return RewardInput(text, [], task)


@pytest.mark.parametrize(("response", "answer", "want"), [
    ("so the result is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The answer is 12", "12", 1.0),
    ("The answer is 12", 12, 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("The answer is 13", "12", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("no number here at all", "12", 0.0),
])
def test_math_verify_scores_real_forms(response, answer, want):
    assert math_verify([inp(response, answer=answer)]) == [want]


def test_math_verify_fails_a_task_without_a_usable_answer_never_zero():
    got = math_verify([inp("\\boxed{1}"), inp("\\boxed{1}", answer=""), inp("\\boxed{1}", answer=[1]),
                       inp("\\boxed{1}", answer="1")])
    assert got[3] == 1.0
    assert isinstance(got[0], RewardFailure) and "task has no 'answer'" in got[0].reason
    assert all(isinstance(g, RewardFailure) and "task['answer']" in g.reason for g in got[1:3])


def test_math_verify_is_registered_and_runs_off_the_main_thread():
    import threading

    assert get_reward_fn("math_verify") is math_verify
    out: list = []
    t = threading.Thread(target=lambda: out.append(math_verify([inp("The answer is 7", answer="7")])))
    t.start()
    t.join(30)
    assert out == [[1.0]]  # its signal-based timeouts are off, so a thread can call it
