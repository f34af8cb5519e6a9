"""Environments by name: what ``env.<name>.environment`` / ``url`` builds in an engine (docs/environments.md).

:class:`EnvironmentSpec` is the plain-value form of a recipe's environment section; :func:`build_environment`
makes the :class:`~rollout.episodes.environment.BoundedEnvironment` the engine plays episodes with: a registered name
(``tool_calls``, ``letter_relay``), a user's ``module:Class`` / ``file.py:Class`` built with
``environment_kwargs``, or an environment server at ``url``. :data:`TOOLS` are the tools a recipe can name.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout.episodes.calculator import CALCULATOR
from rollout.episodes.environment import BoundedEnvironment, as_async
from rollout.episodes.tool_calls import Tool, ToolEnvironment
from rollout.rewards.reward_types import RewardFn

TOOLS: dict[str, Tool] = {"calculator": CALCULATOR}
"""Tools by the name a recipe gives in ``env.<name>.tools``."""
TOOL_CALLS = "tool_calls"
ENVIRONMENTS: dict[str, str] = {"letter_relay": "rollout.episodes.envs.letter_relay:LetterRelay"}
"""Registered environment classes (besides ``tool_calls``), by name -> ``module:Class``."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """An environment section of a recipe (``env.<name>``) as plain values, for the engine's process."""

    name: str
    """The section's name; failure reasons and metrics carry it."""
    environment: str | None = None
    """A registered name, ``module:Class`` / ``file.py:Class``; None with ``url``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor keyword arguments of the class."""
    url: str | None = None
    """An environment server to call instead of a class."""
    tools: tuple[str, ...] = ()
    """Names in :data:`TOOLS` run by ``tool_calls``."""
    max_tool_calls: int = 8
    step_timeout_s: float = 30.0
    """Deadline of one reset / step (of one HTTP attempt for a server)."""
    max_concurrent_calls: int = 64
    max_retries: int = 2
    retry_backoff_s: float = 0.5
    truncated_reward: float | None = 0.0
    """Reward of an episode cut before the environment ended it; None: it fails."""

    def __post_init__(self):
        if (self.environment is None) == (self.url is None):
            raise ValueError(f"env.{self.name}: give exactly one of environment and url")
        if not (math.isfinite(self.step_timeout_s) and self.step_timeout_s > 0):
            raise ValueError(f"env.{self.name}.step_timeout_s: expected a finite number > 0, got {self.step_timeout_s}")
        for t in self.tools:
            if t not in TOOLS:
                raise ValueError(f"env.{self.name}.tools: unknown tool {t!r}; the tools are {sorted(TOOLS)}")

    @property
    def call_deadline_s(self) -> float:
        """The whole deadline of one call: every attempt of a server call and its back-offs, with slack."""
        if self.url is None:
            return self.step_timeout_s
        from rollout.episodes.env_http import longest_call_s

        return longest_call_s(self.step_timeout_s, self.max_retries, self.retry_backoff_s) + 5.0


def tool_schemas(names: Sequence[str]) -> list[dict[str, Any]]:
    """The tools ``names`` as chat templates list them (``apply_chat_template(..., tools=...)``)."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"tools: unknown {unknown}; the tools are {sorted(TOOLS)}")
    return [TOOLS[n].schema() for n in names]


def load_environment_class(path: str) -> type:
    """The class at a registered name or ``package.module:Class`` / ``/path/to/file.py:Class``; it must have
    the :class:`~rollout.episodes.environment.Environment` methods ``reset`` and ``step`` (a class named by mistake, or
    ``subprocess:Popen``, is refused before it is built)."""
    from rollout.rewards.registry import import_attribute

    where = ENVIRONMENTS.get(path, path)
    if ":" not in where:
        raise ValueError(f"environment: expected {TOOL_CALLS!r}, one of {sorted(ENVIRONMENTS)} or 'module:Class' / "
                         f"'file.py:Class', got {path!r}")
    cls = import_attribute(where, "environment")
    if not isinstance(cls, type):
        module_path, _, attr = where.rpartition(":")
        raise ValueError(f"environment {path!r}: {module_path!r} has no class {attr!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {path!r}: {cls.__qualname__} is not an environment (no "
                         f"{' or '.join(missing)} method; expected reset(task) and step(state, turn), "
                         f"docs/environments.md)")
    return cls


def build_environment(spec: EnvironmentSpec, reward_fn: RewardFn, reward_timeout_s: float) -> BoundedEnvironment:
    """The environment of ``spec`` behind its deadline. ``reward_fn`` scores the final answers of ``tool_calls``
    (the section's ``reward_functions``), with ``reward_timeout_s``."""
    env: Any
    if spec.url is not None:
        from rollout.episodes.env_http import HttpEnvironment

        env = HttpEnvironment(spec.url, spec.name, spec.step_timeout_s, spec.max_concurrent_calls, spec.max_retries,
                              spec.retry_backoff_s)
    elif spec.environment == TOOL_CALLS:
        env = ToolEnvironment([TOOLS[t] for t in spec.tools], reward_fn, spec.max_tool_calls,
                              reward_timeout_s=reward_timeout_s, name=spec.name)
    else:
        assert spec.environment is not None
        cls = load_environment_class(spec.environment)
        try:
            env = cls(**spec.kwargs)
        except Exception as exc:  # noqa: BLE001 - a bad kwarg is the recipe's error, said with the section
            raise ValueError(f"env.{spec.name}: {spec.environment}(**environment_kwargs) failed: "
                             f"{type(exc).__name__}: {exc}") from None
    return as_async(env, spec.call_deadline_s, name=spec.name)
