"""A named reward environment (``env.<name>``): several reward functions with weights, run in worker processes.

A sample's reward is ``sum(weight_i * value_i)`` and each function's value travels with it
(``Trajectory.reward_components``, keyed by the function's metric name, :func:`reward_labels`). Every
(sample, function) pair is one task in :class:`RewardWorkers`, with its own deadline; a sample for which any
function fails (raises, times out, returns a non-number) fails with that function's reason -- never 0.
:func:`score_samples` scores a batch with either a plain reward function (the legacy ``env.reward_fn``: one
deadline for the group, run on a thread) or an environment.
"""
from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from rollout.rewards.reward_types import RewardFailure, RewardFn, RewardInput, RewardResult, Scored
from rollout.rewards.reward_workers import RewardWorkers


def reward_labels(names: Sequence[str]) -> dict[str, str]:
    """The metric name of each reward function reference (``reward_<label>_mean``, the Prometheus label): a
    registered name as it is, ``module:function`` / ``/path/file.py:function`` as ``function``, characters other
    than letters, digits and ``_`` replaced by ``_``; a label already taken gets ``_2``, ``_3``... in order. The
    full reference stays in the recipe (``RUN_DIR/recipe.yaml``)."""
    out: dict[str, str] = {}
    for name in names:
        base = re.sub(r"\W", "_", name.rpartition(":")[2], flags=re.ASCII) or "fn"
        label, n = base, 1
        while label in out.values():
            n += 1
            label = f"{base}_{n}"
        out[name] = label
    return out


@dataclass(frozen=True)
class WeightedReward:
    """One function of an environment."""

    name: str
    """Registered name or ``module:function`` / ``file.py:function``."""
    weight: float
    """Its weight in the sample's reward."""


class RewardEnv:
    """Scores samples with several weighted functions in ``num_workers`` processes, ``timeout_s`` per call.

    Also a :data:`~rollout.rewards.reward_types.RewardFn` (``await env(batch)`` gives the weighted rewards), so it can
    stand wherever one function does; :func:`score_samples` keeps the per-function values."""

    def __init__(self, functions: Sequence[WeightedReward], num_workers: int, timeout_s: float, name: str = ""):
        from rollout.rewards.registry import get_reward_fn

        if not functions:
            raise ValueError(f"env.{name or '<name>'}.reward_functions: expected at least one function")
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise ValueError(f"env.{name or '<name>'}.reward_functions: each function at most once, got {names}")
        for f in functions:
            if not (math.isfinite(f.weight) and f.weight > 0):
                raise ValueError(f"env.{name or '<name>'}.reward_functions: weight of {f.name!r} must be a "
                                 f"finite number > 0, got {f.weight}")
            get_reward_fn(f.name)  # a bad name or an import error is a clear error here, not in every sample
        if not timeout_s > 0:
            raise ValueError(f"env.{name or '<name>'}.timeout_s: expected > 0, got {timeout_s}")
        self.name = name
        self.functions = tuple(functions)
        self.labels = reward_labels(names)
        """Each function's metric name (:func:`reward_labels`), the key of its value in ``components``."""
        self.timeout_s = timeout_s
        self.workers = RewardWorkers(names, num_workers, label=name)

    async def score(self, batch: list[RewardInput]) -> list[Scored | RewardFailure]:
        """One :class:`Scored` (weighted reward and each function's value) or failure per sample."""
        return list(await asyncio.gather(*(self._one(sample) for sample in batch)))

    async def _one(self, sample: RewardInput) -> Scored | RewardFailure:
        values = await asyncio.gather(*(self.workers.score(f.name, sample, self.timeout_s)
                                        for f in self.functions))
        for v in values:
            if isinstance(v, RewardFailure):
                return v
        got = [float(v) for v in values]  # pyright: ignore[reportArgumentType]
        components = {self.labels[f.name]: v for f, v in zip(self.functions, got, strict=True)}
        return Scored(math.fsum(f.weight * v for f, v in zip(self.functions, got, strict=True)), components)

    async def __call__(self, batch: list[RewardInput]) -> list[RewardResult]:
        return [s if isinstance(s, RewardFailure) else s.reward for s in await self.score(batch)]

    def close(self) -> None:
        self.workers.close()


async def score_samples(reward: RewardFn, batch: list[RewardInput], timeout_s: float,
                        executor: Executor | None = None) -> list[Scored | RewardFailure]:
    """Score ``batch`` with an environment (per-sample deadlines ``env.<name>.timeout_s``, values kept) or a
    plain function (:func:`rollout.rewards.registry.score_group`: ``timeout_s`` for the group, no values)."""
    if isinstance(reward, RewardEnv):
        return await reward.score(batch)
    from rollout.rewards.registry import score_group

    return [r if isinstance(r, RewardFailure) else Scored(r) for r in
            await score_group(reward, batch, timeout_s, executor)]


def reward_env_from_config(name: str, functions: Sequence[tuple[str, float]], num_workers: int,
                           timeout_s: float) -> RewardEnv:
    """A :class:`RewardEnv` from plain values (``env.<name>``'s reward_functions as (name, weight))."""
    return RewardEnv([WeightedReward(n, w) for n, w in functions], num_workers, timeout_s, name)
