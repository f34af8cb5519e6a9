"""An environment served over HTTP (docs/environment_servers.md): the client the engine plays episodes with.

:class:`HttpEnvironment` is an :class:`~rollout.episodes.environment.AsyncEnvironment` whose ``reset`` / ``step`` are
``POST {url}/reset`` / ``POST {url}/step`` to an environment server (``services.pool.env_server``, or any
server speaking the same JSON). The protocol is stateless: the episode's state travels with every call as
JSON, so any replica can answer. Each call runs with at most ``max_concurrent_calls`` in flight per client,
``timeout_s`` per attempt, and retries with exponential back-off (with jitter) on timeouts, connection errors
and 5xx answers; a 4xx or a malformed answer fails at once. A call that fails raises (``reset``) or gives a
failed step (``step``) whose reason names the environment, the endpoint and what happened -- the sample
fails with it, never reward 0 -- and is counted in :class:`EnvCallStats`.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import httpx

from rollout.episodes.env_answers import AttemptFailed, read_messages, read_step, required_field, show
from rollout.episodes.environment import EnvStep, Message, Turn

FAILURE_KINDS: tuple[str, ...] = ("timeout", "http_5xx", "http_4xx", "malformed", "connection")
"""How a call can fail; each is a counter of :class:`EnvCallStats` and an outcome of the metrics."""
RETRIED_KINDS = frozenset({"timeout", "http_5xx", "connection"})
BODY_CHARS = 200
"""How much of an answer's body a failure reason quotes."""
JITTER_LOW = 0.5
"""A back-off is its base times a jitter in [JITTER_LOW, JITTER_LOW + 1)."""
_JSON_HEADERS = {"content-type": "application/json"}


def backoff_base_s(retry_backoff_s: float, attempt: int) -> float:
    """The back-off after failed attempt ``attempt`` (1-based) before jitter: doubling from ``retry_backoff_s``."""
    return retry_backoff_s * 2 ** (attempt - 1)


def longest_call_s(timeout_s: float, max_retries: int, retry_backoff_s: float) -> float:
    """The longest one call can take: every attempt at its deadline and every back-off at its largest jitter."""
    return timeout_s * (max_retries + 1) + sum(backoff_base_s(retry_backoff_s, a) * (JITTER_LOW + 1)
                                               for a in range(1, max_retries + 1))
T = TypeVar("T")


@dataclass
class EnvCallStats:
    """Counters of one client's calls (``reset`` and ``step``), for logs and the pool's metrics. Every call ends
    in exactly one of ``ok``, ``failed_step`` and the failure kinds, so they sum to ``calls``."""

    calls: int = 0
    """Calls made (a call is every attempt of one ``reset`` / ``step``)."""
    ok: int = 0
    """Calls answered well."""
    failed_step: int = 0
    """Steps the environment itself answered as failed (its own ``EnvStep.failed``)."""
    timeout: int = 0
    """Calls whose last attempt passed ``timeout_s``."""
    http_5xx: int = 0
    """Calls whose last attempt got a 5xx answer (the environment raised, or the server is unavailable)."""
    http_4xx: int = 0
    """Calls answered with a 4xx (or another status that is neither 2xx nor 5xx): not retried."""
    malformed: int = 0
    """Calls answered with something that is not the protocol's JSON (or whose request was not JSON)."""
    connection: int = 0
    """Calls whose last attempt could not connect or lost the connection."""
    retries: int = 0
    """Attempts after the first, over all calls."""
    seconds: float = 0.0
    """Wall seconds spent in calls, attempts and back-offs included."""
    in_flight: int = 0
    """Requests on the wire now."""
    max_in_flight: int = 0
    """The most requests on the wire at once so far (at most ``max_concurrent_calls``)."""

    @property
    def failures(self) -> int:
        """Calls that failed, of any kind."""
        return sum(getattr(self, k) for k in FAILURE_KINDS)

    def snapshot(self) -> dict[str, float]:
        """Every counter by its field name, as floats."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass
class HttpState:
    """An episode's state on the client side: the JSON value the server answered last. Each step sends
    ``value`` and, when answered well, replaces it with the answer's ``state``."""

    value: Any


class EnvironmentCallError(RuntimeError):
    """A call to an environment server failed; ``reason`` names the environment, the endpoint and what
    happened, ``kind`` is one of :data:`FAILURE_KINDS`."""

    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


class HttpEnvironment:
    """The environment server at ``url`` as an :class:`~rollout.episodes.environment.AsyncEnvironment`; see the module
    docstring. ``name`` is in every failure reason and names the counters. ``max_retries`` attempts follow the
    first on a timeout, a connection error or a 5xx, the ``i``-th after a back-off of ``retry_backoff_s * 2**i``
    times a jitter in [0.5, 1.5) (``seed`` makes it repeatable; ``sleep`` replaces ``asyncio.sleep`` in tests).
    ``reset`` raises :class:`EnvironmentCallError`; ``step`` never raises for a failed call, it answers
    ``EnvStep.failed(reason)``. The HTTP client is made on first use in the running event loop; ``aclose`` it
    when done. Proxy variables of the process environment are not used (environment servers are internal)."""

    def __init__(self, url: str, name: str, timeout_s: float = 30.0, max_concurrent_calls: int = 64,
                 max_retries: int = 2, retry_backoff_s: float = 0.5, *, seed: int | None = None,
                 sleep: Callable[[float], Awaitable[Any]] | None = None, role: str = "environment"):
        where = f"{role} {name!r}"
        if not (isinstance(name, str) and name):
            raise ValueError(f"HttpEnvironment name: expected a non-empty string, got {name!r}")
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"{where}: url: expected http://host:port[/prefix] or https://..., got {url!r}")
        if isinstance(timeout_s, bool) or not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s)
                                               and timeout_s > 0):
            raise ValueError(f"{where}: timeout_s: expected a finite number > 0, got {timeout_s!r}")
        if isinstance(max_concurrent_calls, bool) or not (isinstance(max_concurrent_calls, int)
                                                          and max_concurrent_calls >= 1):
            raise ValueError(f"{where}: max_concurrent_calls: expected an integer >= 1, got {max_concurrent_calls!r}")
        if isinstance(max_retries, bool) or not (isinstance(max_retries, int) and max_retries >= 0):
            raise ValueError(f"{where}: max_retries: expected an integer >= 0, got {max_retries!r}")
        if isinstance(retry_backoff_s, bool) or not (isinstance(retry_backoff_s, (int, float))
                                                     and math.isfinite(retry_backoff_s) and retry_backoff_s >= 0):
            raise ValueError(f"{where}: retry_backoff_s: expected a finite number >= 0, got {retry_backoff_s!r}")
        self.url = url.rstrip("/")
        self.name = name
        self.where = where
        """How failure reasons name the server (``environment 'calc'``; an agent server's say ``agent``)."""
        self.timeout_s = float(timeout_s)
        self.max_concurrent_calls = max_concurrent_calls
        self.max_retries = max_retries
        self.retry_backoff_s = float(retry_backoff_s)
        self.stats = EnvCallStats()
        """This client's counters (see :class:`EnvCallStats`)."""
        self._rng = random.Random(seed)
        self._sleep = sleep or asyncio.sleep
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None

    def snapshot(self) -> dict[str, float]:
        """The counters now (:meth:`EnvCallStats.snapshot`)."""
        return self.stats.snapshot()

    async def reset(self, task: dict) -> tuple[HttpState, list[Message]]:
        """``POST /reset``: the episode's state (an :class:`HttpState`) and its first messages."""
        def parse(answer: dict[str, Any]) -> tuple[HttpState, list[Message]]:
            state = required_field(answer, "state")
            return HttpState(state), read_messages(answer.get("messages", []), "messages")

        return await self.call("reset", {"task": task}, parse)

    async def step(self, state: HttpState, turn: Turn) -> EnvStep:
        """``POST /step``: the server's answer to ``turn``; a failed call is a failed step with the reason."""
        if not isinstance(state, HttpState):
            raise TypeError(f"environment {self.name!r}: step: expected the HttpState that reset gave, got "
                            f"{type(state).__name__}")

        def parse(answer: dict[str, Any]) -> EnvStep:
            new_state = required_field(answer, "state")
            got = read_step(answer)
            state.value = new_state
            return got

        body = {"state": state.value, "turn": {"text": turn.text, "token_ids": list(turn.token_ids),
                                               "final": bool(getattr(turn, "final", False))}}
        try:
            return await self.call("step", body, parse)
        except EnvironmentCallError as exc:
            return EnvStep.failed(exc.reason, {"env_failure": exc.kind})

    async def health(self) -> dict[str, Any]:
        """``GET /healthz`` once (no retries, not counted): the server's answer, or :class:`EnvironmentCallError`."""
        client, _ = self._resources()
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await client.get(f"{self.url}/healthz")
            response.raise_for_status()
            return response.json()
        except Exception as exc:  # noqa: BLE001 - any failure is said with the environment's name
            raise EnvironmentCallError(f"environment {self.name!r}: GET /healthz: {_error_text(exc)}",
                                       "connection") from None

    async def aclose(self) -> None:
        """Close the HTTP client (a later call makes a new one)."""
        client, self._client, self._loop, self._semaphore = self._client, None, None, None
        if client is not None:
            await client.aclose()

    async def __aenter__(self) -> HttpEnvironment:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ calls
    async def call(self, endpoint: str, body: dict[str, Any], parse: Callable[[dict[str, Any]], T]) -> T:
        """``POST {url}/{endpoint}`` with ``body`` (JSON), retried as the class says; ``parse`` reads the JSON object
        answered (raising :class:`EnvironmentCallError`'s ``malformed`` through :func:`bad_answer`). Raises
        :class:`EnvironmentCallError` with the reason once the attempts are spent."""
        started = time.monotonic()
        self.stats.calls += 1
        attempts = 0
        try:
            content = _encode(body)
            while True:
                attempts += 1
                try:
                    result = parse(await self._attempt(endpoint, content))
                    break
                except AttemptFailed as exc:
                    if exc.kind not in RETRIED_KINDS or attempts > self.max_retries:
                        raise
                self.stats.retries += 1
                await self._sleep(self.backoff_s(attempts))
        except AttemptFailed as exc:
            setattr(self.stats, exc.kind, getattr(self.stats, exc.kind) + 1)
            reason = f"{self.where}: POST /{endpoint}: {self._describe(exc, attempts)}"
            raise EnvironmentCallError(reason, exc.kind) from None
        finally:
            self.stats.seconds += time.monotonic() - started
        if isinstance(result, EnvStep) and result.failure is not None:
            self.stats.failed_step += 1
        else:
            self.stats.ok += 1
        return result

    def backoff_s(self, attempt: int) -> float:
        """The pause after failed attempt ``attempt`` (1-based): ``retry_backoff_s * 2**(attempt-1)`` times a
        jitter in [0.5, 1.5) from this client's random generator."""
        return backoff_base_s(self.retry_backoff_s, attempt) * (JITTER_LOW + self._rng.random())

    async def _attempt(self, endpoint: str, content: bytes) -> dict[str, Any]:
        client, semaphore = self._resources()
        async with semaphore:
            self.stats.in_flight += 1
            self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
            try:
                async with asyncio.timeout(self.timeout_s):
                    response = await client.post(f"{self.url}/{endpoint}", content=content, headers=_JSON_HEADERS)
            except (TimeoutError, httpx.TimeoutException):
                raise AttemptFailed("timeout", "timed out") from None
            except httpx.TransportError as exc:
                raise AttemptFailed("connection", _error_text(exc)) from None
            finally:
                self.stats.in_flight -= 1
        status = response.status_code
        if status >= 500:
            raise AttemptFailed("http_5xx", f"HTTP {status}", _body_text(response))
        if not 200 <= status < 300:
            raise AttemptFailed("http_4xx", f"HTTP {status}", _body_text(response))
        try:
            answer = json.loads(response.content)
        except ValueError as exc:
            raise AttemptFailed("malformed", f"answered malformed JSON ({exc}): {_clip(response.text)!r}") from None
        if not isinstance(answer, dict):
            raise AttemptFailed("malformed", f"answered {show(answer)}, expected a JSON object")
        return answer

    def _describe(self, exc: AttemptFailed, attempts: int) -> str:
        n = f"{attempts} attempt{'' if attempts == 1 else 's'}"
        if exc.kind == "timeout":
            return f"timed out after {self.timeout_s:g}s ({n})"
        if exc.kind == "connection":
            return f"connection failed after {n}: {exc.detail}"
        if exc.kind == "http_5xx":
            return f"{exc.detail} after {n}: {exc.body}"
        if exc.kind == "http_4xx":
            return f"{exc.detail}: {exc.body}"
        return exc.detail

    def _resources(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._client is None or self._semaphore is None:
            limits = httpx.Limits(max_connections=self.max_concurrent_calls,
                                  max_keepalive_connections=self.max_concurrent_calls)
            self._client = httpx.AsyncClient(timeout=self.timeout_s, limits=limits, trust_env=False)
            self._semaphore = asyncio.Semaphore(self.max_concurrent_calls)
            self._loop = loop
        return self._client, self._semaphore


# ---------------------------------------------------------------------- the answers
def _encode(body: dict[str, Any]) -> bytes:
    try:
        return json.dumps(body, allow_nan=False, default=_jsonable, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise AttemptFailed("malformed", f"request is not JSON-serializable: {exc}") from None


def _jsonable(value: Any) -> Any:
    """NumPy scalars and arrays (rows read with ``datasets`` may hold them) as plain values."""
    for method in ("tolist", "item"):
        if callable(getattr(value, method, None)):
            return getattr(value, method)()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _body_text(response: httpx.Response) -> str:
    """The answer's ``detail`` when it is FastAPI's ``{"detail": "..."}``, else its text; clipped."""
    try:
        detail = json.loads(response.content).get("detail")
    except (ValueError, AttributeError):
        detail = None
    return _clip(detail if isinstance(detail, str) else (response.text or "(empty body)"))


def _clip(text: str) -> str:
    return text if len(text) <= BODY_CHARS else text[:BODY_CHARS - 3] + "..."


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
