"""What ``env.<name>.agent`` names, made callable by the driver: your coroutine, or an agent server over HTTP.

:func:`load_agent` imports ``package.module:function`` / ``/path/to/file.py:function`` and checks it is
``async def run(task, client)``. :class:`AgentServer` calls an agent server in NeMo-Gym's shape
(docs/agents.md, "Agent servers"): ``POST <url>/run`` with the task's fields, the sample's model endpoint as
``policy_base_url`` / ``policy_api_key`` / ``policy_model_name`` (the names of NeMo-Gym's ``env.yaml``) and, when
the task carries one, ``responses_create_params``; the answer's ``reward`` is the sample's reward. Timeouts,
connection errors and 5xx are retried with back-off (:class:`~rollout.episodes.env_http.HttpEnvironment`'s).
"""
from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rollout.episodes.env_answers import bad_answer, required_field
from rollout.episodes.env_http import EnvironmentCallError, HttpEnvironment

if TYPE_CHECKING:
    from services.pool.agent_driver import AgentSpec

AgentFn = Callable[[dict, Any], Awaitable[Any]]
"""``async def run(task, client) -> reward``."""
CREATE_PARAMS = "responses_create_params"


def load_agent(path: str, name: str) -> AgentFn:
    """The coroutine function at ``path``; a clear error if it is missing or not ``async def run(task, client)``."""
    from rollout.rewards.registry import import_attribute

    fn = import_attribute(path, "agent")
    if fn is None:
        raise ValueError(f"env.{name}.agent ({path!r}): the module has no {path.rpartition(':')[2]!r}")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"env.{name}.agent ({path!r}): expected a coroutine function `async def run(task, client)`, "
                         f"got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind({}, None)
    except TypeError as exc:
        raise ValueError(f"env.{name}.agent ({path!r}): cannot be called as run(task, client): {exc}") from None
    return fn


class AgentServer:
    """The agent server at ``spec.agent``: one ``POST /run`` per episode, its deadline ``spec.timeout_s`` per
    attempt, ``spec.max_retries`` retries."""

    def __init__(self, spec: AgentSpec):
        self.spec = spec
        self.http = HttpEnvironment(spec.agent, spec.name, spec.timeout_s, spec.max_concurrent, spec.max_retries,
                                    spec.retry_backoff_s, role="agent server")

    async def run(self, task: dict, base_url: str, key: str) -> tuple[Any, int]:
        """The reward the server answers for ``task`` (checked by the driver), and the retries it took; raises
        :class:`~services.pool.agent_driver.AgentFailed` with the reason when the call fails."""
        from services.pool.agent_driver import AgentFailed

        retries = self.http.stats.retries
        try:
            reward = await self.http.call("run", run_body(task, base_url, key, self.spec.model_name), _reward)
        except EnvironmentCallError as exc:
            raise AgentFailed(exc.kind, exc.reason) from None
        return reward, self.http.stats.retries - retries

    async def aclose(self) -> None:
        await self.http.aclose()


def run_body(task: dict, base_url: str, key: str, model: str) -> dict[str, Any]:
    """The ``/run`` request: the task's fields, ``responses_create_params`` (decoded when the task holds it as JSON
    text) and the model endpoint of the sample's session."""
    body: dict[str, Any] = dict(task)
    params = body.get(CREATE_PARAMS)
    if isinstance(params, str):
        try:
            body[CREATE_PARAMS] = json.loads(params)
        except json.JSONDecodeError:
            pass  # sent as the task holds it: the server says what it expected
    body.update(policy_base_url=f"{base_url}/v1", policy_api_key=key, policy_model_name=model)
    return body


def _reward(answer: dict[str, Any]) -> Any:
    reward = required_field(answer, "reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise bad_answer("reward", "a number", reward)
    return reward
