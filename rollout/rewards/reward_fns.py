"""Built-in reward functions: ``math_exact`` (hand-written numeric parsing; ``math_verify`` is the trusted one),
``format`` and ``repeat_letter``. Each scores a list of :class:`~rollout.rewards.reward_types.RewardInput` and
returns one float or :class:`~rollout.rewards.reward_types.RewardFailure` per sample (docs/rollout.md, "Rewards")."""
from __future__ import annotations

import math
import re

from rollout.rewards.reward_types import RewardFailure, RewardInput, RewardResult

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_FINAL_FORM = re.compile(r"(\\boxed\{[^{}]*\}|[Tt]he answer is\s*-?\d+(?:\.\d+)?)\s*\.?\s*$")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(text: str) -> float | None:
    """The numeric answer of a response: ``\\boxed{}`` content, else the last number."""
    boxed = _last_boxed(text)
    source = boxed if boxed is not None else text
    numbers = _NUMBER.findall(source.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def math_exact(batch: list[RewardInput]) -> list[RewardResult]:
    """1.0 if the extracted numeric answer equals ``task["answer"]``, else 0.0."""
    out: list[RewardResult] = []
    for sample in batch:
        if "answer" not in sample.task:
            out.append(RewardFailure("math_exact: task has no 'answer'"))
            continue
        try:
            want = float(sample.task["answer"])
        except (TypeError, ValueError):
            out.append(RewardFailure(f"math_exact: task['answer'] is not a number: {sample.task['answer']!r}"))
            continue
        got = extract_answer(sample.text)
        out.append(1.0 if got is not None and math.isclose(got, want, rel_tol=0.0, abs_tol=1e-9) else 0.0)
    return out


def format_reward(batch: list[RewardInput]) -> list[RewardResult]:
    """1.0 if the response ends with ``\\boxed{...}`` or ``The answer is N``, else 0.0."""
    return [1.0 if _FINAL_FORM.search(sample.text.strip()) else 0.0 for sample in batch]


def repeat_letter(batch: list[RewardInput]) -> list[RewardResult]:
    """Fraction of response tokens in the target set (0.0 for an empty response)."""
    out: list[RewardResult] = []
    for sample in batch:
        targets = _repeat_targets(sample.task)
        if isinstance(targets, RewardFailure):
            out.append(targets)
            continue
        ids = list(sample.response_ids)
        out.append(sum(1 for t in ids if t in targets) / len(ids) if ids else 0.0)
    return out


def _repeat_targets(task: dict) -> set[int] | RewardFailure:
    many = task.get("target_token_ids")
    if many is not None:
        try:
            return {int(x) for x in str(many).split(",") if x.strip()}
        except ValueError:
            return RewardFailure(f"repeat_letter: task['target_token_ids'] must be comma-separated ints, "
                                 f"got {many!r}")
    one = task.get("target_token_id")
    if isinstance(one, bool) or not isinstance(one, int):
        return RewardFailure(f"repeat_letter: task['target_token_id'] must be an int, got {one!r}")
    return {one}
