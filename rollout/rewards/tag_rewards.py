"""Rewards of tagged answers, as NeMo-RL's vision-language recipes score them (CLEVR-CoGenT: 0.2 + 0.8).

``tag_format`` is NeMo-RL's ``format_reward``: 0.25 for a ``<think>...</think>`` span anywhere in the response
plus 0.75 for an ``<answer>...</answer>`` span (NeMo-RL's VLM environment calls it ``format``; Inflight's ``format``
is the math one). ``exact_alnum`` is NeMo-RL's ``exact_answer_alphanumeric_reward``: 1.0 when the text between
the answer tags, with everything but letters and digits removed and lower-cased, equals ``task["answer"]``
treated the same way, else 0.0; a tagged ``task["answer"]`` (CLEVR-CoGenT's ``solution``: ``<answer> 3 </answer>``)
counts by its tagged text, as NeMo-RL's ``format_answer_fromtags`` reads it. A task without an answer fails its
samples.
"""
from __future__ import annotations

import re

from rollout.rewards.reward_types import RewardFailure, RewardInput, RewardResult

_THINK = re.compile(r"<think>[\s\S]*</think>")
_ANSWER = re.compile(r"<answer>([\s\S]*)</answer>")
_FIRST_ANSWER = re.compile(r"<answer>(.*?)</answer>")  # NeMo-RL's format_answer_fromtags
THINK_SHARE, ANSWER_SHARE = 0.25, 0.75


def tag_format(batch: list[RewardInput]) -> list[RewardResult]:
    """0.25 for think tags plus 0.75 for answer tags (each a span, in any order)."""
    return [THINK_SHARE * bool(_THINK.search(s.text)) + ANSWER_SHARE * bool(_ANSWER.search(s.text)) for s in batch]


def _alnum(text: str) -> str:
    return "".join(c for c in text if c.isalnum()).lower()


def exact_alnum(batch: list[RewardInput]) -> list[RewardResult]:
    """1.0 when the tagged answer equals ``task["answer"]`` up to case and non-alphanumerics, else 0.0."""
    out: list[RewardResult] = []
    for sample in batch:
        want = sample.task.get("answer")
        if want is None:
            out.append(RewardFailure("exact_alnum: task has no 'answer'"))
            continue
        tagged = _FIRST_ANSWER.search(str(want))
        want = tagged.group(1) if tagged is not None else str(want)
        got = _ANSWER.search(sample.text)
        out.append(1.0 if got is not None and _alnum(got.group(1)) == _alnum(want) else 0.0)
    return out
