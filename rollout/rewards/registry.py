"""Reward functions: one interface, a registry, and a bounded scorer.

A reward function scores a whole group at once: a list of :class:`RewardInput`
(response text, token ids, the prompt's ``task``) in, one float or
:class:`RewardFailure` per sample out; plain or coroutine function.
:func:`score_group` runs it under a deadline and turns every failure
(exception, timeout, wrong count, non-finite value) into per-sample
:class:`RewardFailure` s -- never into reward 0. :func:`get_reward_fn` knows
``math_verify`` and ``dapo_math_verify`` (:mod:`rollout.rewards.math_verify_reward`), ``math_exact``, ``format``
and ``repeat_letter`` (:mod:`rollout.rewards.reward_fns`; docs/rollout.md, "Rewards"), ``tag_format`` and
``exact_alnum`` (:mod:`rollout.rewards.tag_rewards`),
or loads ``module:function`` / ``file.py:function``. Several weighted functions
in worker processes: :mod:`rollout.rewards.reward_env`.
"""
from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import cast

from rollout.rewards.math_verify_reward import dapo_math_verify, math_verify
from rollout.rewards.reward_fns import extract_answer, format_reward, math_exact, repeat_letter
from rollout.rewards.reward_types import RewardFailure, RewardFn, RewardInput, RewardResult, Scored
from rollout.rewards.tag_rewards import exact_alnum, tag_format

__all__ = ["REWARD_FNS", "RewardFailure", "RewardFn", "RewardInput", "RewardResult", "Scored", "check_results",
           "dapo_math_verify", "extract_answer", "format_reward", "get_reward_fn", "math_exact", "math_verify",
           "repeat_letter", "score_group"]

REWARD_FNS: dict[str, RewardFn] = {
    "math_verify": math_verify,
    "dapo_math_verify": dapo_math_verify,
    "math_exact": math_exact,
    "format": format_reward,
    "repeat_letter": repeat_letter,
    "tag_format": tag_format,
    "exact_alnum": exact_alnum,
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
    fn = import_attribute(name, "reward function")
    if not callable(fn):
        raise ValueError(f"reward function {name!r}: {name.rpartition(':')[0]!r} has no callable "
                         f"{name.rpartition(':')[2]!r}")
    _check_signature(name, fn)
    return cast(RewardFn, fn)  # a user's function: its results are checked at every call (check_results)


def _check_signature(name: str, fn: Callable[..., object]) -> None:
    """A reward function is a Python function (or an object with a Python ``__call__``) that takes the batch as
    its one positional argument: a class (``subprocess:Popen``) or a builtin (``os:system``) is refused."""
    expected = "expected a function taking one argument, the list of RewardInput"
    if isinstance(fn, type) or inspect.isbuiltin(fn) or inspect.ismethoddescriptor(fn):
        raise ValueError(f"reward function {name!r}: a {type(fn).__name__}, not a Python function; {expected}")
    try:
        inspect.signature(fn).bind(None)
    except (TypeError, ValueError):
        raise ValueError(f"reward function {name!r}: its signature does not take one argument; {expected}") from None


def import_attribute(name: str, what: str) -> object:
    """The attribute ``attr`` of ``module:attr`` / ``file.py:attr`` (None if the module lacks it); a module that
    cannot be imported is a ``ValueError`` naming ``what`` and ``name``."""
    where, _, attr = name.rpartition(":")
    try:
        module = _load_module(where)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported with the name
        raise ValueError(f"{what} {name!r}: cannot import {where!r}: {type(exc).__name__}: {exc}") from None
    return getattr(module, attr, None)


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


def check_results(results: object, n: int) -> list[RewardResult]:
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
    return check_results(results, len(batch))
