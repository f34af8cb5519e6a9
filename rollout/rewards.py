"""Reward functions: one interface, a registry, and a bounded scorer.

A reward function scores a whole group at once: a list of :class:`RewardInput`
(response text, token ids, the prompt's ``task``) in, one float or
:class:`RewardFailure` per sample out; plain or coroutine function.
:func:`score_group` runs it under a deadline and turns every failure
(exception, timeout, wrong count, non-finite value) into per-sample
:class:`RewardFailure` s -- never into reward 0. :func:`get_reward_fn` knows
``math_exact``, ``format`` and ``repeat_letter`` (docs/rollout.md, "Rewards"),
or loads ``module:function`` / ``file.py:function``.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import cast


@dataclass(frozen=True)
class RewardInput:
    """One sample to score."""

    text: str
    response_ids: Sequence[int]
    task: dict


@dataclass(frozen=True)
class RewardFailure:
    """A sample the reward function could not score, with the reason."""

    reason: str


RewardResult = float | RewardFailure
RewardFn = Callable[[list[RewardInput]], list[RewardResult] | Awaitable[list[RewardResult]]]
"""Scores a batch of samples; plain or ``async``; one result per sample."""

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


REWARD_FNS: dict[str, RewardFn] = {
    "math_exact": math_exact,
    "format": format_reward,
    "repeat_letter": repeat_letter,
}


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward function by name, or a user's own: ``package.module:function`` (importable
    where the engines run) or ``/path/to/file.py:function``. It must take ``list[RewardInput]`` and
    return one float (or :class:`RewardFailure`) per sample, plain or ``async``."""
    if name in REWARD_FNS:
        return REWARD_FNS[name]
    if ":" not in name:
        raise ValueError(f"reward function: expected one of {sorted(REWARD_FNS)} or 'module:function' / "
                         f"'file.py:function', got {name!r}")
    where, _, attr = name.rpartition(":")
    try:
        module = _load_module(where)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported with the name
        raise ValueError(f"reward function {name!r}: cannot import {where!r}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {name!r}: {where!r} has no callable {attr!r}")
    return cast(RewardFn, fn)  # a user's function: its results are checked at every call (_check_results)


def _load_module(where: str):
    import importlib
    import importlib.util

    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"inflight_user_reward_{abs(hash(where))}", where)
        if spec is None or spec.loader is None:
            raise ImportError(f"no Python file at {where}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(where)


def _check_results(results: object, n: int) -> list[RewardResult]:
    if not isinstance(results, (list, tuple)) or len(results) != n:
        got = f"{len(results)} results" if isinstance(results, (list, tuple)) else type(results).__name__
        return [RewardFailure(f"reward function returned {got}, expected a list of {n}")] * n
    out: list[RewardResult] = []
    for r in results:
        if isinstance(r, RewardFailure):
            out.append(r)
        elif isinstance(r, bool) or not isinstance(r, (int, float)):
            out.append(RewardFailure(f"reward is not a number: {r!r}"))
        elif not math.isfinite(r):
            out.append(RewardFailure(f"reward is not finite: {r!r}"))
        else:
            out.append(float(r))
    return out


def _is_async(fn: RewardFn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(fn.__call__)


async def score_group(reward_fn: RewardFn, batch: list[RewardInput], timeout_s: float,
                      executor: Executor | None = None) -> list[RewardResult]:
    """Run ``reward_fn`` on ``batch`` within ``timeout_s``; failures become per-sample failures.

    Plain functions run on ``executor`` (default: the loop's). A plain
    function that hangs keeps its worker thread busy after the timeout --
    Python cannot stop a thread -- but the group is not held up."""
    if not batch:
        return []
    loop = asyncio.get_running_loop()
    try:
        call: Awaitable[object]
        if _is_async(reward_fn):
            call = cast(Awaitable[object], reward_fn(batch))
        else:
            call = loop.run_in_executor(executor, reward_fn, batch)
        results = await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        return [RewardFailure(f"reward function timed out after {timeout_s:g}s")] * len(batch)
    except Exception as exc:  # noqa: BLE001 -- any reward error fails the samples, with its text
        return [RewardFailure(f"reward function raised {type(exc).__name__}: {exc}")] * len(batch)
    return _check_results(results, len(batch))
