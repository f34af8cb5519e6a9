"""A pool of reward worker processes (``pebble.ProcessPool``): one task scores one sample with one function,
under a deadline that kills the worker running it (pebble starts a fresh one), so a function that hangs --
sympy can -- fails only its own sample and the pool keeps working.

Functions travel by name (``math_verify``, ``pkg.module:function``, ``/path/file.py:function``) and are loaded in
the worker (:func:`rollout.rewards.registry.get_reward_fn`), never pickled. Workers are started with ``spawn``:
the engine process runs vLLM and Ray threads, which a forked child must not inherit. Math-Verify's signal-based
timeouts are off (:mod:`rollout.rewards.math_verify_reward`); the kill at the deadline replaces them.
"""
from __future__ import annotations

import asyncio
import inspect
import multiprocessing
from collections.abc import Sequence

from rollout.rewards.reward_types import RewardFailure, RewardFn, RewardInput, RewardResult

_LOADED: dict[str, RewardFn] = {}
"""Functions loaded in this worker process, by name."""


def _load(name: str) -> RewardFn:
    from rollout.rewards.registry import get_reward_fn

    if name not in _LOADED:
        _LOADED[name] = get_reward_fn(name)
    return _LOADED[name]


def warm_up(names: Sequence[str]) -> None:
    """Worker initializer: load every function (and, for ``math_verify``, sympy) before the first deadline runs."""
    for name in names:
        try:
            _load(name)
            if name == "math_verify":
                _load(name)([RewardInput("\\boxed{1}", [], {"answer": "1"})])
        except Exception:  # noqa: BLE001 - a load error is reported by the task that needs the function
            continue


def score_one(name: str, sample: RewardInput) -> RewardResult:
    """In a worker: score ``sample`` with the function called ``name``; every failure becomes a RewardFailure."""
    from rollout.rewards.registry import check_results

    try:
        fn = _load(name)
        results = fn([sample])
        if inspect.isawaitable(results):
            results = asyncio.run(_awaited(results))
    except Exception as exc:  # noqa: BLE001 - any reward error fails the sample, with its text
        return RewardFailure(f"reward function {name} raised {type(exc).__name__}: {exc}"[:1000])
    result = check_results(results, 1)[0]
    if isinstance(result, RewardFailure) and not result.reason.startswith(f"{name}:"):
        return RewardFailure(f"reward function {name}: {result.reason}"[:1000])
    return result


async def _awaited(awaitable):
    return await awaitable


class RewardWorkers:
    """``num_workers`` processes scoring samples by function name; started on the first call."""

    def __init__(self, names: Sequence[str], num_workers: int, label: str = ""):
        if num_workers < 1:
            raise ValueError(f"num_workers: expected >= 1, got {num_workers}")
        self.names = tuple(names)
        self.num_workers = num_workers
        self.label = label
        self._pool = None
        self.timeouts = 0
        """Tasks killed at their deadline."""

    def _started(self):
        if self._pool is None:
            from pebble import ProcessPool

            self._pool = ProcessPool(max_workers=self.num_workers, initializer=warm_up, initargs=(self.names,),
                                     context=multiprocessing.get_context("spawn"))
        return self._pool

    async def score(self, name: str, sample: RewardInput, timeout_s: float) -> RewardResult:
        """Score one sample in a worker; past ``timeout_s`` (counted from when the task starts running) the
        worker is killed and the result is a failure naming the function and the deadline."""
        from pebble import ProcessExpired

        try:
            future = self._started().schedule(score_one, args=(name, sample), timeout=timeout_s)
        except RuntimeError as exc:  # a pool whose workers could not start: the next call starts a new one
            self.close()
            return RewardFailure(f"reward function {name}: the reward worker pool failed: {exc}"[:300])
        try:
            return await asyncio.wrap_future(future)
        except TimeoutError:
            self.timeouts += 1
            return RewardFailure(f"reward function {name} timed out after {timeout_s:g}s")
        except ProcessExpired as exc:
            return RewardFailure(f"reward function {name}: its worker process died ({exc})")
        except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be pickled back
            return RewardFailure(f"reward function {name} failed in its worker: {type(exc).__name__}: {exc}"[:1000])

    def close(self) -> None:
        """Stop the workers (a running task is killed)."""
        if self._pool is not None:
            self._pool.stop()
            self._pool = None
