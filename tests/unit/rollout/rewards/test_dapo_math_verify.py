"""``dapo_math_verify`` (rollout/rewards/math_verify_reward.py): DAPO's check as NeMo-RL's dapo_math_verifier has it, on
hand-computed cases; and ``env.<name>.math_verify_impl: dapo_math_verify`` choosing it for ``math_verify``."""
from __future__ import annotations

import pytest

from rollout.rewards.math_verify_reward import dapo_math_verify, dapo_normalize
from rollout.rewards.reward_types import RewardFailure, RewardInput
from rollout.rewards.registry import REWARD_FNS
from services.recipe.data import RewardEnvConfig


def score(text: str, answer: object) -> object:
    return dapo_math_verify([RewardInput(text, [], {"answer": answer})])[0]


@pytest.mark.parametrize("text, answer, want", [
    ("2 + 2 is four.\nAnswer: 4", "4", 1.0),
    ("Answer: 5", "4", 0.0),
    ("answer:   42", "42", 1.0),                                   # case-insensitive, spaces after the colon
    ("Answer: 3\nwait, no.\nAnswer: 7", "7", 1.0),                  # the last Answer line counts
    ("Answer: 3\nwait, no.\nAnswer: 7", "3", 0.0),
    ("The result is \\boxed{4}.", "4", 0.0),                        # no Answer line: [INVALID]
    ("Answer: 1,000", "1000", 1.0),                                 # thousands separators of an integer
    ("Answer: 5 degrees", "5", 1.0),                                # units removed
    ("Answer: x = 3", "3", 1.0),                                    # after the last '='
    ("Answer: $\\frac{1}{2}$", "\\frac12", 1.0),                    # $..$ unwrapped, \frac12 -> \frac{1}{2}
    ("Answer: \\boxed{12}", "12", 1.0),
    ("Answer: \\text{(B)}", "(B)", 1.0),
    ("Answer: 0.5", "\\frac{1}{2}", 0.0),                           # strings, not values (unlike math_verify)
    ("Answer: 9" + "x" * 300, "9", 0.0),                            # only the last 300 characters are read
    ("x" * 300 + "Answer: 9", "9", 1.0),
    ("Answer: 12", 12, 1.0),                                        # a numeric reference
])
def test_dapo_math_verify_by_hand(text, answer, want):
    assert score(text, answer) == want


def test_normalize_by_hand():
    assert dapo_normalize("  a  $ 3 $ ") == "3"                     # 'a ' dropped, $..$ unwrapped, spaces gone
    assert dapo_normalize("\\sqrt2") == "\\sqrt{2}"
    assert dapo_normalize("10 \\text{ cm}") == "10"
    assert dapo_normalize("\\overline{AB}") == "AB"


def test_a_reference_that_is_missing_or_empty_fails_the_sample():
    assert isinstance(score("Answer: 1", None), RewardFailure)
    failure = score("Answer: $", "$ $")
    assert isinstance(failure, RewardFailure) and "empty once normalised" in failure.reason
    assert isinstance(dapo_math_verify([RewardInput("Answer: 1", [], {})])[0], RewardFailure)


def test_registered_and_chosen_by_math_verify_impl():
    assert REWARD_FNS["dapo_math_verify"] is dapo_math_verify
    env = RewardEnvConfig.model_validate({"math_verify_impl": "dapo_math_verify", "num_workers": 4})
    assert [f.name for f in env.reward_functions] == ["dapo_math_verify"]
    env = RewardEnvConfig.model_validate({"math_verify_impl": "dapo_math_verify", "reward_functions": [
        {"name": "format", "weight": 0.2}, {"name": "math_verify", "weight": 0.8}]})
    assert [(f.name, f.weight) for f in env.reward_functions] == [("format", 0.2), ("dapo_math_verify", 0.8)]
    assert [f.name for f in RewardEnvConfig().reward_functions] == ["math_verify"]
    with pytest.raises(ValueError, match="math_verify_impl"):
        RewardEnvConfig.model_validate({"math_verify_impl": "sympy"})
