"""The agent driver (docs/agents.md): ``env.<name>.agent`` plays each sample through the pool's OpenAI endpoint.

For every prompt of a batch the engine runs ``group_size`` agent episodes at once, each in a rollout session of
its own named ``<engine id>:<random>`` (the ingress sends the session's calls to this engine, which splices the
session's earlier answers into each next prompt and captures every token served). The agent is your coroutine
``run(task, client)``, given an ``openai.AsyncOpenAI`` client whose key is the session's rollout key, or an agent
server (:mod:`services.pool.agent_server`). When the agent gives its reward, the session's calls become one
trajectory token in, token out (:func:`~services.pool.session_episode.session_episode`); an agent that fails,
times out, gives no finite reward or breaks its session fails its sample with the reason, never reward 0.
"""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from protocol import PromptRequest, Trajectory, TrajectoryGroup
from rollout.completion_order import in_completion_order
from rollout.counters import EnvCounters
from rollout.episodes.episode import failed_trajectory
from services.pool.openai_api import rollout_key
from services.pool.session_episode import SessionBroken, session_episode
from services.pool.token_capture import CapturedCompletion

if TYPE_CHECKING:
    from services.recipe.config import Recipe

AGENT_OUTCOMES = ("ok", "timeout", "agent_error", "bad_reward", "session_broken", "http_5xx", "http_4xx",
                  "malformed", "connection")
"""How one agent episode ends; each is counted (``inflight_env_calls{outcome}``)."""


@dataclass(frozen=True)
class PoolAccess:
    """How an engine's agents reach the pool: its base URL and the secret rollout keys are minted with."""

    base_url: str
    """``http://host:port[/route_prefix]`` of the pool's Serve proxy, as seen from the engines' nodes."""
    key_secret: str
    """:func:`services.pool.openai_api.rollout_key_secret` of the admin token."""


@dataclass(frozen=True)
class AgentSpec:
    """An ``env.<name>.agent`` section as plain values, for the engine's process."""

    name: str
    agent: str
    """``module:function`` / ``file.py:function``, or an agent server's URL."""
    base_url: str
    """The pool's URL as the agent reaches it (without ``/v1``)."""
    key_secret: str
    model_name: str
    timeout_s: float
    max_concurrent: int
    """Episodes one engine runs at once."""
    max_retries: int
    retry_backoff_s: float

    @property
    def is_server(self) -> bool:
        return self.agent.startswith(("http://", "https://"))

    @classmethod
    def from_recipe(cls, recipe: Recipe, access: PoolAccess | None) -> AgentSpec | None:
        """``env.<data.env_name>``'s agent, or None when the section has none."""
        name = recipe.data.env_name
        if name is None or (e := recipe.env.named[name]).agent is None:
            return None
        if access is None:
            raise ValueError(f"env.{name}.agent: the pool did not say where agents reach it (no PoolAccess)")
        return cls(name, e.agent, (e.agent_base_url or access.base_url).rstrip("/"), access.key_secret,
                   recipe.policy.model_name, e.agent_timeout_s, e.max_concurrent_calls, e.max_retries,
                   e.retry_backoff_s)


class AgentFailed(Exception):
    """One episode failed: ``outcome`` (one of :data:`AGENT_OUTCOMES`) and the reason its sample carries."""

    def __init__(self, outcome: str, reason: str):
        super().__init__(reason)
        self.outcome, self.reason = outcome, reason


@dataclass
class AgentStats:
    """Counters of the driver (cumulative), as the pool's environment metrics read them."""

    episodes: int = 0
    env_failures: int = 0
    env_wait_seconds: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    retries: int = 0

    def count(self, outcome: str, seconds: float) -> None:
        self.episodes += 1
        self.env_failures += outcome != "ok"
        self.env_wait_seconds += seconds
        self.calls[outcome] = self.calls.get(outcome, 0) + 1


class AgentDriver:
    """Plays prompts with ``spec``'s agent on engine ``engine_id``; ``take_session`` takes a session's captured
    calls from this engine's chat server; ``vocab_size`` is the engine's."""

    def __init__(self, spec: AgentSpec, engine_id: str, take_session: Callable[[str], list[CapturedCompletion]],
                 vocab_size: Callable[[], int]):
        from services.pool.agent_server import AgentServer, load_agent

        self.spec, self.engine_id = spec, engine_id
        self._take_session, self._vocab_size = take_session, vocab_size
        self._server = AgentServer(spec) if spec.is_server else None
        self._run = None if spec.is_server else load_agent(spec.agent, spec.name)
        self._slots: asyncio.Semaphore | None = None
        self._http: Any = None
        self.stats = AgentStats()
        self._groups = 0

    async def generate(self, requests: Sequence[PromptRequest], group_size: int) -> AsyncIterator[TrajectoryGroup]:
        """One group per request, played concurrently; each yielded as soon as it is complete."""
        async for group in in_completion_order(self.group(r, group_size) for r in requests):
            yield group

    async def evaluate(self, requests: Sequence[PromptRequest],
                       group_size: int) -> list[TrajectoryGroup | BaseException]:
        """Validation: each request's group (the agent samples at its own temperature), or what stopped it."""
        return list(await asyncio.gather(*(self.group(r, group_size) for r in requests), return_exceptions=True))

    async def group(self, request: PromptRequest, group_size: int) -> TrajectoryGroup:
        """``group_size`` episodes of ``request``'s task, each its own session, laid out on one shared prompt."""
        sessions = [f"{self.engine_id}:{uuid.uuid4().hex}" for _ in range(group_size)]
        played = await asyncio.gather(*(self._episode(request.task, s) for s in sessions))
        captured = [self._take_session(s) for s in sessions]
        prompt = _shared_prompt([c for c, (o, _) in zip(captured, played, strict=True)
                                 if not isinstance(o, AgentFailed)], request.prompt_ids)
        trajectories: list[Trajectory] = []
        for calls, (outcome, seconds) in zip(captured, played, strict=True):
            if not isinstance(outcome, AgentFailed):
                try:
                    trajectories.append(session_episode(calls, outcome, prompt).trajectory)
                    self.stats.count("ok", seconds)
                    continue
                except SessionBroken as exc:
                    outcome = AgentFailed("session_broken", f"agent {self.spec.name!r}: session refused: {exc}")
            self.stats.count(outcome.outcome, seconds)
            trajectories.append(failed_trajectory(outcome.reason, "environment"))
        self._groups += 1
        return TrajectoryGroup(f"{self.engine_id}:{request.prompt_id}:agent{self._groups}", request.prompt_id,
                               np.asarray(prompt), trajectories, group_size, self._vocab_size(),
                               request.scheduled_step, self.engine_id, time.time())

    async def _episode(self, task: dict, session: str) -> tuple[float | AgentFailed, float]:
        """One episode's reward, or how it failed; and the seconds it took."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.spec.max_concurrent)
        async with self._slots:
            started = time.monotonic()
            try:
                outcome: float | AgentFailed = _checked_reward(await self._play(task, session), self.spec.name)
            except AgentFailed as exc:
                outcome = exc
            return outcome, time.monotonic() - started

    async def _play(self, task: dict, session: str) -> Any:
        key = rollout_key(self.spec.key_secret, session)
        if self._server is not None:
            reward, retries = await self._server.run(task, self.spec.base_url, key)
            self.stats.retries += retries
            return reward
        assert self._run is not None
        client = self._client(key)
        try:
            async with asyncio.timeout(self.spec.timeout_s):
                return await self._run(task, client)
        except TimeoutError:
            raise AgentFailed("timeout", f"agent {self.spec.name!r}: the episode took over "
                                         f"{self.spec.timeout_s:g}s (env.{self.spec.name}.agent_timeout_s)") from None
        except Exception as exc:  # noqa: BLE001 - the agent's own failure fails its sample, with the reason
            raise AgentFailed("agent_error", f"agent {self.spec.name!r} raised {type(exc).__name__}: "
                                             f"{exc}"[:500]) from None

    def _client(self, key: str) -> Any:
        """An ``openai.AsyncOpenAI`` for one session (its key); one HTTP connection pool per driver."""
        import httpx
        import openai

        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.spec.timeout_s, trust_env=False,
                                           limits=httpx.Limits(max_connections=self.spec.max_concurrent))
        return openai.AsyncOpenAI(base_url=f"{self.spec.base_url}/v1", api_key=key, http_client=self._http,
                                  timeout=self.spec.timeout_s)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._server is not None:
            await self._server.aclose()

    def env_counters(self) -> EnvCounters:
        """The counters as an engine's environment counters (the pool's ``inflight_env_*`` metrics); an agent
        counts no turns, environment tokens or truncations."""
        s = self.stats
        return EnvCounters(self.spec.name, episodes=s.episodes, env_failures=s.env_failures,
                           env_wait_seconds=s.env_wait_seconds, calls=dict(s.calls), retries=s.retries)

    def snapshot(self) -> dict[str, Any]:
        """:meth:`env_counters` as plain values (an engine's ``stats()["env"]``)."""
        return self.env_counters().as_dict()


def _checked_reward(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AgentFailed("bad_reward", f"agent {name!r} gave reward {value!r}; expected a finite number")
    return float(value)


def _shared_prompt(sessions: list[list[CapturedCompletion]], fallback: np.ndarray) -> list[int]:
    """The longest token prefix of the group's first prompts (what every episode begins with); ``fallback`` (the
    data prompt) when no episode made a call or the first prompts share no token."""
    firsts = [min(calls, key=lambda c: len(c.prompt_token_ids)).prompt_token_ids for calls in sessions if calls]
    if not firsts:
        return [int(t) for t in fallback]
    prefix = list(firsts[0])
    for ids in firsts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(prefix, ids, strict=False)) if a != b), min(len(prefix), len(ids)))
        prefix = prefix[:n]
    return prefix or [int(t) for t in fallback]  # no token in common: each episode is refused against the data's
