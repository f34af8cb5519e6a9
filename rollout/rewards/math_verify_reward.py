"""``math_verify``: 1.0 when the response's final answer equals ``task["answer"]`` by Hugging Face Math-Verify
(``math_verify.parse`` both, ``math_verify.verify``), else 0.0; a task without a parsable answer fails.

Math-Verify's own timeouts use ``signal.alarm`` and work only in a process's main thread; they are switched off
here (``parsing_timeout=None``, ``timeout_seconds=None``) because on timeout they silently give "not equal",
i.e. a 0 that is not a measurement. The deadline is enforced from outside instead: in a named environment every
call runs in a worker process (:mod:`rollout.rewards.reward_workers`) that is killed at ``env.<name>.timeout_s``, and
the sample fails with the reason. Used as a single ``env.reward_fn`` it runs on a thread, where a hang keeps
its thread busy (the group still fails at ``env.reward_timeout_s``).

``dapo_math_verify`` is DAPO's string check (NeMo-RL's ``math_verify_impl: dapo_math_verify``), below.
"""
from __future__ import annotations

import re

from rollout.rewards.reward_types import RewardFailure, RewardInput, RewardResult


def _quiet() -> None:
    """Math-Verify warns once per process that its timeouts are off; the deadline is ours (module docstring)."""
    import math_verify.grader
    import math_verify.parser

    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True


def _parse(text: str, raise_on_error: bool) -> list:
    from math_verify import parse

    _quiet()

    return parse(text, parsing_timeout=None, raise_on_error=raise_on_error)  # pyright: ignore[reportArgumentType]


def _gold(answer: object) -> list | RewardFailure:
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        return RewardFailure(f"math_verify: task['answer'] must be a non-empty string or number, got {answer!r}")
    text = str(answer).strip()
    try:
        gold = _parse(text, raise_on_error=True) or _parse(f"\\boxed{{{text}}}", raise_on_error=True)
    except Exception as exc:  # noqa: BLE001 - an unparsable reference fails the sample, with the reason
        return RewardFailure(f"math_verify: cannot parse task['answer'] {text!r}: {type(exc).__name__}: {exc}")
    if not gold:
        return RewardFailure(f"math_verify: cannot parse task['answer'] {text!r}")
    return gold


def math_verify(batch: list[RewardInput]) -> list[RewardResult]:
    """1.0 if Math-Verify finds the response's answer equal to ``task["answer"]`` (``\\boxed{\\frac{1}{2}}``
    equals ``0.5``; "The answer is 12" equals ``12``), else 0.0 (also for a response with no answer)."""
    from math_verify import verify

    out: list[RewardResult] = []
    for sample in batch:
        if "answer" not in sample.task:
            out.append(RewardFailure("math_verify: task has no 'answer'"))
            continue
        gold = _gold(sample.task["answer"])
        if isinstance(gold, RewardFailure):
            out.append(gold)
            continue
        pred = _parse(sample.text, raise_on_error=False)  # an unparsable response is a wrong answer
        out.append(1.0 if pred and verify(gold, pred, timeout_seconds=None) else 0.0)
    return out


# ``dapo_math_verify``: DAPO's answer check, as NeMo-RL's ``nemo_rl/environments/dapo_math_verifier.py`` has it
# (adapted there from verl's ``verl/utils/reward_score/math_dapo.py``, Apache-2.0, Bytedance Ltd. and NVIDIA).
# The response's last ``Answer: ...`` line within its last 300 characters, normalised (Minerva's rules), must
# equal the normalised reference. Pure string rules: Math-Verify's symbolic equality is a different check.
_DAPO_TAIL_CHARS = 300
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                       (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
_DAPO_REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                 "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                 "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                 "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
                 r",\!", "{,}", '"', "\\dots"]


def dapo_normalize(answer: str) -> str:
    """Minerva's normalisation of a final answer (DAPO): the part after the last ``=``, units and spacing
    removed, ``$...$``, ``\\text{}``, ``\\textbf{}``, ``\\overline{}`` and ``\\boxed{}`` unwrapped, ``\\fracab`` ->
    ``\\frac{a}{b}``, ``\\sqrta`` -> ``\\sqrt{a}``, thousands separators of a plain integer dropped."""
    answer = answer.split("=")[-1]
    for before, after in _DAPO_SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _DAPO_REMOVED:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_math_verify(batch: list[RewardInput]) -> list[RewardResult]:
    """1.0 if the last ``Answer: ...`` line of the response's last 300 characters, normalised
    (:func:`dapo_normalize`), equals the normalised ``task["answer"]``, else 0.0 (also with no such line). A task
    whose answer is missing or normalises to nothing fails the sample."""
    out: list[RewardResult] = []
    for sample in batch:
        answer = sample.task.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            out.append(RewardFailure(f"dapo_math_verify: task['answer'] must be a string or number, got {answer!r}"))
            continue
        gold = dapo_normalize(str(answer))
        if not gold:
            out.append(RewardFailure(f"dapo_math_verify: task['answer'] {answer!r} is empty once normalised"))
            continue
        found = _DAPO_ANSWER.findall(sample.text[-_DAPO_TAIL_CHARS:])
        out.append(1.0 if found and dapo_normalize(found[-1]) == gold else 0.0)
    return out
