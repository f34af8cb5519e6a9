"""What an environment server must answer (docs/environment_servers.md): the JSON of ``/reset`` and ``/step`` read
into the episode's types, or a failed attempt of kind ``malformed`` that names the field and what was expected.
:class:`~rollout.episodes.env_http.HttpEnvironment` reads its answers with these, and so does any other caller of
:meth:`~rollout.episodes.env_http.HttpEnvironment.call` (an agent server's ``/run``).
"""
from __future__ import annotations

from typing import Any

from rollout.episodes.environment import ROLES, EnvStep, Message


class AttemptFailed(Exception):
    """One attempt failed: ``kind``, ``detail`` (what happened) and the answer's ``body`` where there is one."""

    def __init__(self, kind: str, detail: str, body: str = ""):
        super().__init__(detail)
        self.kind, self.detail, self.body = kind, detail, body


def bad_answer(where: str, expected: str, value: Any) -> AttemptFailed:
    """A malformed answer at field ``where`` (raise it in a ``parse`` of
    :meth:`~rollout.episodes.env_http.HttpEnvironment.call`)."""
    return AttemptFailed("malformed", f"answer field {where!r}: expected {expected}, got {show(value)}")


def required_field(answer: dict[str, Any], key: str) -> Any:
    """``answer[key]``, or a malformed answer naming the missing field."""
    if key not in answer:
        raise AttemptFailed("malformed", f"answer has no field {key!r} (fields: {sorted(answer)})")
    return answer[key]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_messages(value: Any, where: str) -> list[Message]:
    """The messages at answer field ``where``: a list of ``{role, content[, name, tool_call_id]}``."""
    if not isinstance(value, list):
        raise bad_answer(where, "a list of messages", value)
    out = []
    for i, m in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise bad_answer(at, "an object {role, content}", m)
        if m.get("role") not in ROLES:
            raise bad_answer(f"{at}.role", f"one of {list(ROLES)}", m.get("role"))
        if not isinstance(m.get("content"), str):
            raise bad_answer(f"{at}.content", "a string", m.get("content"))
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise bad_answer(f"{at}.{key}", "a string or null", m[key])
        out.append(Message(m["role"], m["content"], m.get("name"), m.get("tool_call_id")))
    return out


def read_step(answer: dict[str, Any]) -> EnvStep:
    """A ``/step`` answer (``done``, ``reward``, ``failure``, ``components``, ``info``, ``observation``) as a step."""
    done = required_field(answer, "done")
    if not isinstance(done, bool):
        raise bad_answer("done", "true or false", done)
    reward = answer.get("reward")
    if reward is not None and not _is_number(reward):
        raise bad_answer("reward", "a number or null", reward)
    failure = answer.get("failure")
    if failure is not None and not isinstance(failure, str):
        raise bad_answer("failure", "a string or null", failure)
    components = answer.get("components") or {}
    if not isinstance(components, dict):
        raise bad_answer("components", "an object of numbers", components)
    for k, v in components.items():
        if not _is_number(v):
            raise bad_answer(f"components.{k}", "a number", v)
    info = answer.get("info") or {}
    if not isinstance(info, dict):
        raise bad_answer("info", "an object of strings and numbers", info)
    for k, v in info.items():
        if not (_is_number(v) or isinstance(v, str)):
            raise bad_answer(f"info.{k}", "a string or a number", v)
    observation = read_messages(answer.get("observation") or [], "observation")
    try:
        return EnvStep(observation=observation, reward=reward, done=done, info=info, components=components,
                       failure=failure)
    except (TypeError, ValueError) as exc:
        raise AttemptFailed("malformed", f"answered an invalid step: {exc}") from None


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)``, clipped to ``limit`` characters for a failure reason."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
