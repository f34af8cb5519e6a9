"""Tool calls in the Qwen/Hermes format and the environment that runs them (docs/environments.md, "Tool calls").

A sampled turn calls tools with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the format
Qwen2.5's and Qwen3's chat templates teach; :func:`parse_tool_calls` reads every block of a turn. Each call is
answered by one ``tool`` message (the template wraps it in ``<tool_response>`` inside a user turn). Malformed
JSON, a missing name, an unknown tool, bad arguments or a :class:`ToolError` from the tool become an
``error: ...`` message the model reads -- never an exception. :class:`ToolEnvironment`: a turn with calls gets
their results, a turn without is the final answer, scored by the reward function.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from rollout.episodes.environment import EnvStep, Message, Turn, score_turn
from rollout.rewards.reward_types import RewardFn

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


class ToolError(Exception):
    """Raised by a tool for input it cannot use; its text goes back to the model as the call's result. Any
    other exception of a tool is the environment's failure (the sample fails with it)."""


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BadToolCall:
    """A ``<tool_call>`` block that is not a call, and what is wrong with it (``name`` when it has one)."""

    error: str
    name: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall | BadToolCall]:
    """Every ``<tool_call>`` block of ``text`` in order (text around them is ignored); ``[]`` if there is none.
    ``arguments`` may be a JSON object or a string holding one; missing means ``{}``. An unclosed last block
    (a turn cut at the token limit) is a :class:`BadToolCall`."""
    calls: list[ToolCall | BadToolCall] = []
    end = 0
    for i, match in enumerate(_BLOCK.finditer(text), 1):
        calls.append(_parse_one(i, match.group(1)))
        end = match.end()
    if _OPEN in text[end:]:
        calls.append(BadToolCall(f"tool call {len(calls) + 1} has no closing </tool_call>"))
    return calls


def _parse_one(i: int, body: str) -> ToolCall | BadToolCall:
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError as exc:
        return BadToolCall(f"tool call {i} is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})")
    except (ValueError, RecursionError) as exc:  # an integer of over 4300 digits, nesting too deep
        return BadToolCall(f"tool call {i} is not valid JSON: {_first_line(exc)}")
    if not isinstance(call, dict):
        return BadToolCall(f'tool call {i} must be a JSON object {{"name": ..., "arguments": {{...}}}}, got '
                           f"{_json_type(call)}")
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        return BadToolCall(f'tool call {i} has no "name" (a non-empty string)')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return BadToolCall(f"tool call {i} ({name}): arguments are not valid JSON: {exc.msg}", name)
        except (ValueError, RecursionError) as exc:
            return BadToolCall(f"tool call {i} ({name}): arguments are not valid JSON: {_first_line(exc)}", name)
    if not isinstance(arguments, dict):
        return BadToolCall(f"tool call {i} ({name}): arguments must be a JSON object, got {_json_type(arguments)}",
                           name)
    return ToolCall(name, arguments)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "boolean": (bool,), "object": (dict,), "array": (list,),
                                            "null": (type(None),)}


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    for name in ("null", "string", "integer", "number", "object", "array"):
        if isinstance(value, _JSON_TYPES[name]):
            return "null" if name == "null" else _article(name)
    return type(value).__name__


def _article(json_type: object) -> str:
    return f"an {json_type}" if str(json_type)[:1] in "aeiou" else f"a {json_type}"


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: ``fn(**arguments)`` returns the result text (plain or ``async``; a non-string
    result is sent as JSON). ``parameters`` is the JSON Schema of the arguments (``properties``,
    ``required``); calls are checked against it before ``fn`` runs."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any | Awaitable[Any]]

    def __post_init__(self):
        if not self.name or not isinstance(self.parameters.get("properties", {}), dict):
            raise ValueError(f"Tool {self.name!r}: needs a name and parameters {{'properties': {{...}}}}")

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates list it (``apply_chat_template(..., tools=[...])``)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def check(self, arguments: Mapping[str, Any]) -> str | None:
        """What is wrong with ``arguments`` (unknown, missing or mistyped), or None."""
        properties: dict[str, Any] = self.parameters.get("properties", {})
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"unknown argument(s) {unknown}; {self.name} takes {sorted(properties)}"
        missing = [p for p in self.parameters.get("required", []) if p not in arguments]
        if missing:
            return f"missing argument(s) {missing}"
        for key, value in arguments.items():
            want = properties[key].get("type") if isinstance(properties[key], dict) else None
            types = _JSON_TYPES.get(want) if isinstance(want, str) else None
            bad_bool = want in ("integer", "number") and isinstance(value, bool)
            if types is not None and (not isinstance(value, types) or bad_bool):
                return f"argument {key!r} must be {_article(want)}, got {_json_type(value)}"
            if isinstance(value, float) and not math.isfinite(value):
                return f"argument {key!r} must be finite, got {value!r}"
        return None


async def run_tool_call(tools: Mapping[str, Tool], call: ToolCall | BadToolCall) -> Message:
    """The ``tool`` message that answers ``call``: the tool's result, or ``error: ...`` saying what was wrong."""
    return (await _answer(tools, call))[0]


async def _answer(tools: Mapping[str, Tool], call: ToolCall | BadToolCall) -> tuple[Message, bool]:
    """The answer to ``call`` and whether the call worked."""
    if isinstance(call, BadToolCall):
        return Message("tool", f"error: {call.error}", name=call.name), False
    tool = tools.get(call.name)
    if tool is None:
        return Message("tool", f"error: unknown tool {call.name!r}; the tools are {sorted(tools)}",
                       name=call.name), False
    problem = tool.check(call.arguments)
    if problem is not None:
        return Message("tool", f"error: {call.name}: {problem}", name=call.name), False
    try:
        if inspect.iscoroutinefunction(tool.fn):
            result = await tool.fn(**call.arguments)
        else:
            result = await asyncio.to_thread(tool.fn, **call.arguments)
    except ToolError as exc:
        return Message("tool", f"error: {call.name}: {exc}", name=call.name), False
    return Message("tool", result if isinstance(result, str) else json.dumps(result), name=call.name), True


@dataclass
class ToolState:
    """One episode of a :class:`ToolEnvironment`."""

    task: dict
    tool_calls: int = 0
    """Calls answered so far (malformed ones included)."""


class ToolEnvironment:
    """Tools the model calls in its turns, then a final answer scored by ``reward_fn``.

    A turn with ``<tool_call>`` blocks is answered with one ``tool`` message per block (not done); a turn
    without is the final answer: ``reward_fn`` scores it (its text and token ids, the prompt's ``task``) as a
    single-turn reward would. A turn whose calls would pass ``max_tool_calls`` for the episode is scored as the
    final answer instead (``info["stop"] = "max_tool_calls"``). :meth:`tool_schemas` is what the prompt's chat
    template needs to describe the tools (``apply_chat_template(..., tools=env.tool_schemas())``)."""

    def __init__(self, tools: Sequence[Tool], reward_fn: RewardFn, max_tool_calls: int = 8,
                 reward_timeout_s: float = 60.0, executor: Executor | None = None, name: str = "tools"):
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"ToolEnvironment: each tool name at most once, got {names}")
        if isinstance(max_tool_calls, bool) or not isinstance(max_tool_calls, int) or max_tool_calls < 0:
            raise ValueError(f"ToolEnvironment max_tool_calls: expected an int >= 0, got {max_tool_calls!r}")
        if not (math.isfinite(reward_timeout_s) and reward_timeout_s > 0):
            raise ValueError(f"ToolEnvironment reward_timeout_s: expected a finite number > 0, got {reward_timeout_s}")
        self.tools = {t.name: t for t in tools}
        self.reward_fn = reward_fn
        self.max_tool_calls = max_tool_calls
        self.reward_timeout_s = reward_timeout_s
        self.executor = executor
        self.name = name

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    async def reset(self, task: dict) -> tuple[ToolState, list[Message]]:
        return ToolState(dict(task)), []

    async def step(self, state: ToolState, turn: Turn) -> EnvStep:
        calls = parse_tool_calls(turn.text)
        info: dict[str, str | float] = {"tool_calls": state.tool_calls}
        if not calls or turn.final or state.tool_calls + len(calls) > self.max_tool_calls:
            if calls:  # no turn may follow this one: its text is the final answer
                info["stop"] = "last_turn" if turn.final else "max_tool_calls"
            return await score_turn(self.reward_fn, state.task, turn, self.reward_timeout_s, self.executor, info)
        state.tool_calls += len(calls)
        answers = [await _answer(self.tools, call) for call in calls]
        return EnvStep.more([m for m, _ in answers], {"tool_calls": state.tool_calls,
                                                      "tool_errors": sum(1 for _, ok in answers if not ok)})
