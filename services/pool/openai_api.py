"""The pool's OpenAI-compatible face, ingress side: who may call it, what a request must be, OpenAI-shaped errors.

``POST /v1/chat/completions`` is answered by one of the pool's engines through vLLM's own chat serving
(:mod:`services.pool.openai_engine`); the ingress only checks what it can without the model: the caller's key,
the body's size and JSON shape, the bounds of ``n`` / ``max_tokens`` / ``stream``, and how many requests run at
once. Every refusal has OpenAI's error shape as vLLM writes it (``{"error": {"message", "type", "param",
"code"}}``), so the official ``openai`` client raises its usual exceptions. Pure: no Ray, no vLLM.

Who may call: the pool's *serving key*, an HMAC of the admin token (:func:`serving_key`), the admin token itself,
or a *rollout key* (:func:`rollout_key`), which the agent driver hands an agent for one session: it generates in
that session only. No key can pause, drain or scale the pool, and the admin token cannot be recovered from one
(docs/security.md). A session's calls go to one engine (:class:`SessionRoutes`).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest ``/v1/chat/completions`` body (a long multi-turn conversation with tools fits many times over)."""
MAX_N = 64
"""Most answers one request may ask for (``n``)."""
SERVING_KEY_CONTEXT = b"inflight openai serving v1"
ROLLOUT_KEY_CONTEXT = b"inflight rollout keys v1"
ROLLOUT_KEY_PREFIX = "ifr1."
MAX_ROUTES = 4096
"""Sessions whose engine the ingress remembers (the oldest is forgotten beyond)."""


@dataclass(frozen=True)
class OpenAIError(Exception):
    """A refusal in OpenAI's shape: HTTP ``status``, a ``message``, vLLM's error ``type`` and the ``param``."""

    status: int
    message: str
    type: str = "BadRequestError"
    param: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class ChatLimits:
    """The bounds the ingress checks before an engine sees a request."""

    max_model_len: int
    """``policy.max_total_sequence_length``: ``max_tokens`` may not exceed it (vLLM checks prompt + answer)."""
    max_n: int = MAX_N
    max_body_bytes: int = MAX_BODY_BYTES


@dataclass(frozen=True)
class ChatBody:
    """What the ingress needs to know of a checked request."""

    stream: bool
    n: int


def serving_key(admin_token: str) -> str:
    """The key agents use for ``/v1/chat/completions``: HMAC-SHA256 of a fixed context under the admin token."""
    return hmac.new(admin_token.encode(), SERVING_KEY_CONTEXT, hashlib.sha256).hexdigest()


def rollout_key_secret(admin_token: str) -> str:
    """What engines mint rollout keys with (:func:`rollout_key`): an HMAC of the admin token, so an engine never
    holds the admin token itself."""
    return hmac.new(admin_token.encode(), ROLLOUT_KEY_CONTEXT, hashlib.sha256).hexdigest()


def rollout_key(secret: str, session: str) -> str:
    """The key of one rollout ``session``: ``ifr1.<session>.<HMAC of the session under secret>``. It can generate
    in that session only (the ingress reads the session from it)."""
    mac = hmac.new(secret.encode(), session.encode(), hashlib.sha256).hexdigest()
    return f"{ROLLOUT_KEY_PREFIX}{session}.{mac}"


def check_key(authorization: str | None, admin_token: str) -> str | None:
    """Accept ``Authorization: Bearer <serving key, admin token or rollout key>``; the session a rollout key is
    bound to (None for the others); raise a 401 :class:`OpenAIError` for anything else."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and token.startswith(ROLLOUT_KEY_PREFIX):
        session = token[len(ROLLOUT_KEY_PREFIX):].rpartition(".")[0]
        if session and hmac.compare_digest(token.encode(),
                                           rollout_key(rollout_key_secret(admin_token), session).encode()):
            return session
    elif scheme.lower() == "bearer" and token != "" and any(
            hmac.compare_digest(token.encode(), k.encode()) for k in (serving_key(admin_token), admin_token)):
        return None
    raise OpenAIError(401, "the pool's OpenAI endpoints need 'Authorization: Bearer <serving key or rollout key>' "
                           "(docs/agents.md)", "AuthenticationError")


SESSION_HEADER = "x-inflight-session"
"""The header that puts a request in a rollout session (its tokens are kept for the trainer)."""


def check_session(value: str | None, bound: str | None = None) -> str | None:
    """The request's rollout session: the header's id (1..128 of ``A-Z a-z 0-9 _ . : -``), or ``bound``, the session
    of the caller's rollout key (a header naming another session is refused: 403); None for neither."""
    if value is not None and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", value):
        raise OpenAIError(400, f"{SESSION_HEADER}: 1..128 characters of A-Z a-z 0-9 _ . : -", param=SESSION_HEADER)
    if bound is not None and value not in (None, bound):
        raise OpenAIError(403, f"{SESSION_HEADER}: this rollout key is for another session", "PermissionDeniedError",
                          param=SESSION_HEADER)
    return bound if bound is not None else value


class SessionRoutes:
    """Which engine answers each call of a rollout session: all of them go to one engine, so that it splices the
    session's earlier answers into the next prompt and the driver takes the session where it runs. A session named
    ``<engine id>:<anything>`` (the agent driver's) goes to that engine while it is up; any other session to the
    engine its first call went to, while that one serves; calls outside a session, round robin."""

    def __init__(self, max_routes: int = MAX_ROUTES):
        self.max_routes = max_routes
        self._routes: OrderedDict[str, str] = OrderedDict()
        self._next = 0

    def engine_for(self, session: str | None, serving: list[str], up: list[str]) -> str | None:
        """The engine for a call in ``session`` (None: none serving); ``up``: engines that are up at any version."""
        owner = session.rpartition(":")[0] if session else ""
        if owner and owner in up:
            return owner
        if session and self._routes.get(session) in serving:
            self._routes.move_to_end(session)
            return self._routes[session]
        if not serving:
            return None
        eid = serving[self._next % len(serving)]
        self._next += 1
        if session:
            self._routes[session] = eid
            while len(self._routes) > self.max_routes:
                self._routes.popitem(last=False)
        return eid


def _int_field(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(400, f"{name}: expected an integer, got {type(value).__name__}", param=name)
    if not low <= value <= high:
        raise OpenAIError(400, f"{name}: expected {low}..{high}, got {value}", param=name)
    return value


def check_chat_body(raw: bytes, limits: ChatLimits) -> ChatBody:
    """Check what the ingress can of a ``/v1/chat/completions`` body (the engine's vLLM checks the rest)."""
    if len(raw) > limits.max_body_bytes:
        raise OpenAIError(413, f"the request body is {len(raw)} bytes; at most {limits.max_body_bytes}")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OpenAIError(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    if not isinstance(body.get("model"), str):
        raise OpenAIError(400, "model: required, a string (GET /v1/models names it)", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise OpenAIError(400, "messages: required, a non-empty list of message objects", param="messages")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise OpenAIError(400, f"stream: expected a boolean, got {type(stream).__name__}", param="stream")
    n = _int_field(body, "n", 1, limits.max_n)
    for name in ("max_tokens", "max_completion_tokens"):
        _int_field(body, name, 1, limits.max_model_len)
    return ChatBody(bool(stream), 1 if n is None else n)


def model_list(model: str, max_model_len: int, version: int, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one model the pool serves, with the policy version it serves now."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "inflight",
                                        "root": model, "max_model_len": max_model_len, "policy_version": version}]}


ChatOutcome = Literal["ok", "engine_error", "hung_up"]
"""How a chat request ended: answered (an error vLLM wrote in OpenAI's shape included), the engine failed or timed
out (a 503, or a stream cut short), or the caller left before the answer's end."""


class ChatPlaces:
    """The pool's places for chat requests at once (``vllm_cfg.max_num_seqs``); every taken place is given back
    with its outcome, which a gauge of places in use and a counter by outcome show (``/metrics``)."""

    def __init__(self, size: int, in_use: Any, answered: Any):
        self._free = asyncio.Semaphore(size)
        self.in_use = in_use
        """``inflight_openai_requests_running``, a Prometheus gauge."""
        self.answered = answered
        """``inflight_openai_requests{outcome}``, a Prometheus counter."""

    def refuse_if_full(self) -> None:
        if self._free.locked():
            raise OpenAIError(429, "too many chat requests at once; retry later", "RateLimitError")

    async def take(self) -> None:
        await self._free.acquire()
        self.in_use.inc()

    def give_back(self, outcome: ChatOutcome) -> None:
        self._free.release()
        self.in_use.dec()
        self.answered.labels(outcome).inc()
