"""Environments: the interface a task implements to talk with the model over several turns (docs/environments.md).

An environment starts an episode from a prompt's ``task`` (``reset``: a state and the messages put before the
model's first turn) and answers each sampled turn (``step``: more messages, or the final reward and done).
Plain or ``async``; :func:`as_async` runs either under a per-call deadline and turns an exception, a timeout
or a malformed answer into a failed step whose reason names the environment -- never reward 0.
:class:`SingleTurnEnvironment` is a reward function as the one-step environment: today's rewards, unchanged.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, get_args

from rollout.rewards.reward_env import score_samples
from rollout.rewards.reward_types import RewardFailure, RewardFn, RewardInput

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)
Info = dict[str, str | float]
"""Per-step facts for logs and metrics (``{"tool_calls": 2}``); strings or numbers."""


@dataclass(frozen=True)
class Message:
    """One chat turn, as the model's chat template takes it (:meth:`to_chat`)."""

    role: Role
    content: str
    name: str | None = None
    """The tool's name on a ``tool`` message (templates that show it; Qwen's does not need it)."""
    tool_call_id: str | None = None
    """The call a ``tool`` message answers, for templates that pair them by id (Mistral, Llama 3.1)."""

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"Message.role: expected one of {ROLES}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise TypeError(f"Message.content: expected a string, got {type(self.content).__name__}")

    def to_chat(self) -> dict[str, str]:
        """``{"role", "content"}`` (and ``name`` / ``tool_call_id`` when set) for ``apply_chat_template``."""
        out = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True)
class Turn:
    """One sampled turn of the model: its text and, for rewards that score tokens, its token ids."""

    text: str
    token_ids: tuple[int, ...] = ()
    final: bool = False
    """No further turn will be sampled after this one (``grpo.max_rollout_turns`` reached or the context is
    nearly full): answer done."""

    def __post_init__(self):
        object.__setattr__(self, "token_ids", tuple(self.token_ids))  # the engine's lists are welcome too


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to a turn: more ``observation`` (not done), the final ``reward`` (done), or a
    ``failure`` (done, no reward: the sample fails with this reason). Build one with :meth:`more`,
    :meth:`final` or :meth:`failed`; the constructor refuses a mix (a reward before done, messages after it)."""

    observation: list[Message] = field(default_factory=list)
    """The messages that answer the turn; empty when done."""
    reward: float | None = None
    """The episode's reward, set exactly when done and not failed."""
    done: bool = False
    info: Info = field(default_factory=dict)
    components: dict[str, float] = field(default_factory=dict)
    """Each reward function's (unweighted) value, for a weighted reward environment."""
    failure: str | None = None
    """Why the environment could not go on; the sample fails with it."""

    def __post_init__(self):
        if self.failure is not None:
            if not (isinstance(self.failure, str) and self.failure):
                raise ValueError(f"EnvStep.failure: expected a non-empty reason, got {self.failure!r}")
            if not self.done or self.reward is not None or self.observation:
                raise ValueError("EnvStep: a failed step is done, with no reward and no observation")
        elif self.done:
            if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)):
                raise ValueError(f"EnvStep.reward: a done step needs a number, got {self.reward!r}")
            if not math.isfinite(self.reward):
                raise ValueError(f"EnvStep.reward: expected a finite number, got {self.reward!r}")
            if self.observation:
                raise ValueError("EnvStep.observation: a done step has no observation")
            object.__setattr__(self, "reward", float(self.reward))
        else:
            if self.reward is not None or self.components:
                raise ValueError("EnvStep.reward: only a done step has a reward")
            if not self.observation:
                raise ValueError("EnvStep.observation: a step that is not done needs at least one message")
        if not isinstance(self.observation, list) or not all(isinstance(m, Message) for m in self.observation):
            raise TypeError(f"EnvStep.observation: expected a list of Message, got {self.observation!r}")
        for k, v in self.info.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (str, int, float)):
                raise TypeError(f"EnvStep.info: {k!r}: expected a string or a number, got {v!r}")
        for k, v in self.components.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TypeError(f"EnvStep.components: {k!r}: expected a finite number, got {v!r}")

    @classmethod
    def more(cls, observation: list[Message], info: Info | None = None) -> EnvStep:
        """Not done: ``observation`` answers the turn and the model samples the next one."""
        return cls(observation=list(observation), info=dict(info or {}))

    @classmethod
    def final(cls, reward: float, components: dict[str, float] | None = None, info: Info | None = None) -> EnvStep:
        """Done, with the episode's ``reward``."""
        return cls(reward=reward, done=True, info=dict(info or {}), components=dict(components or {}))

    @classmethod
    def failed(cls, reason: str, info: Info | None = None) -> EnvStep:
        """Done without a reward: the sample fails with ``reason``."""
        return cls(done=True, failure=reason, info=dict(info or {}))


StateT = TypeVar("StateT")


class Environment(Protocol[StateT]):
    """A plain environment. ``state`` is whatever the environment keeps per episode (a dict, a dataclass);
    ``step`` may change it in place. A whole example in 15 lines: docs/environments.md ("An environment in 15
    lines"; the unit tests run it as written there)."""

    def reset(self, task: dict) -> tuple[StateT, list[Message]]:
        """The episode's state and the messages before the model's first turn (``[]``: the prompt as the
        data made it)."""
        ...

    def step(self, state: StateT, turn: Turn) -> EnvStep:
        """The answer to one sampled turn."""
        ...


class AsyncEnvironment(Protocol[StateT]):
    """The same interface with ``async`` methods (for environments that await a server or a reward)."""

    async def reset(self, task: dict) -> tuple[StateT, list[Message]]: ...

    async def step(self, state: StateT, turn: Turn) -> EnvStep: ...


class _Failed(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class BoundedEnvironment:
    """An environment behind a deadline (:func:`as_async`): ``await reset`` / ``await step`` never raise. A
    call that raises, passes ``timeout_s`` or answers something malformed gives a failed :class:`EnvStep`
    whose reason names the environment. A plain method runs on ``executor``'s threads (default: the loop's);
    one that hangs keeps its thread after the deadline -- Python cannot stop a thread -- but the episode
    does not wait for it."""

    def __init__(self, env: Environment[Any] | AsyncEnvironment[Any], timeout_s: float, name: str | None = None,
                 executor: Executor | None = None):
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"environment timeout_s: expected a finite number > 0, got {timeout_s}")
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise TypeError(f"environment {type(env).__name__}: has no method {method}(); see "
                                f"rollout.episodes.environment.Environment")
        self.env = env
        self.timeout_s = timeout_s
        self.name = name or str(getattr(env, "name", "") or type(env).__name__)
        self.executor = executor

    async def reset(self, task: dict) -> tuple[Any, list[Message]] | EnvStep:
        """``(state, messages)``, or a failed :class:`EnvStep` if the environment could not start."""
        try:
            got = await self._call("reset", self.env.reset, dict(task))
            if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], list)
                    and all(isinstance(m, Message) for m in got[1])):
                raise _Failed(f"reset returned {_short(got)}, expected (state, list[Message])")
            return got
        except _Failed as exc:
            return EnvStep.failed(f"environment {self.name!r}: {exc.reason}")

    async def step(self, state: Any, turn: Turn) -> EnvStep:
        """The environment's answer to ``turn``, or a failed step with the reason."""
        try:
            got = await self._call("step", self.env.step, state, turn)
        except _Failed as exc:
            return EnvStep.failed(f"environment {self.name!r}: {exc.reason}")
        if not isinstance(got, EnvStep):
            return EnvStep.failed(f"environment {self.name!r}: step returned {_short(got)}, expected an EnvStep")
        if got.failure is not None:
            if got.failure.startswith(self._prefix):  # a server client names the environment already
                return got
            return EnvStep.failed(f"{self._prefix}{got.failure}", got.info)
        return got

    @property
    def _prefix(self) -> str:
        return f"environment {self.name!r}: "

    async def _call(self, what: str, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.wait_for(self._run(method, *args), self.timeout_s)
        except TimeoutError:
            raise _Failed(f"{what} timed out after {self.timeout_s:g}s") from None
        except Exception as exc:  # noqa: BLE001 -- any error of the environment fails the sample, with its text
            if str(exc).startswith(self._prefix):  # a server client's reason, naming the environment already
                raise _Failed(str(exc)[len(self._prefix):]) from None
            raise _Failed(f"{what} raised {type(exc).__name__}: {exc}") from None

    async def _run(self, method: Callable[..., Any], *args: Any) -> Any:
        if inspect.iscoroutinefunction(method):
            return await method(*args)
        got = await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(method, *args))
        return await got if inspect.isawaitable(got) else got


def as_async(env: Environment[Any] | AsyncEnvironment[Any], timeout_s: float, name: str | None = None,
             executor: Executor | None = None) -> BoundedEnvironment:
    """``env`` (plain or ``async``) behind a per-call deadline of ``timeout_s``: see :class:`BoundedEnvironment`.
    ``name`` (default: ``env.name``, else its class name) appears in every failure reason."""
    return BoundedEnvironment(env, timeout_s, name, executor)


def _short(value: object, limit: int = 120) -> str:
    text = f"{type(value).__name__} {value!r}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class SingleTurnEnvironment:
    """A reward function as the one-step environment: ``reset`` adds nothing to the prompt, and the first turn
    is the answer, scored and done. The reward, the per-function ``components`` of a weighted
    :class:`~rollout.rewards.reward_env.RewardEnv` and every :class:`~rollout.rewards.reward_types.RewardFailure`
    (as a failed step, ``"reward: <reason>"``) are what :func:`~rollout.rewards.reward_env.score_samples` gives
    for the sample today; ``timeout_s`` bounds a plain function (a ``RewardEnv`` keeps its own per-function
    deadline)."""

    def __init__(self, reward_fn: RewardFn, timeout_s: float = 60.0, executor: Executor | None = None,
                 name: str = "single_turn"):
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"SingleTurnEnvironment timeout_s: expected a finite number > 0, got {timeout_s}")
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self.executor = executor
        self.name = name

    async def reset(self, task: dict) -> tuple[dict, list[Message]]:
        return dict(task), []

    async def step(self, state: dict, turn: Turn) -> EnvStep:
        return await score_turn(self.reward_fn, state, turn, self.timeout_s, self.executor)


async def score_turn(reward_fn: RewardFn, task: dict, turn: Turn, timeout_s: float,
                     executor: Executor | None = None, info: Info | None = None) -> EnvStep:
    """``turn`` as the final answer to ``task``, scored by ``reward_fn``: a done step, or a failed one."""
    [score] = await score_samples(reward_fn, [RewardInput(turn.text, list(turn.token_ids), dict(task))],
                                  timeout_s, executor)
    if isinstance(score, RewardFailure):
        return EnvStep.failed(f"reward: {score.reason}", info)
    return EnvStep.final(score.reward, dict(score.components), info)
