"""An agent server called in NeMo-Gym's shape (services/pool/agent_server.py) against a real uvicorn app on
127.0.0.1: the ``/run`` body carries the task's fields, the session's model endpoint and the decoded
``responses_create_params``; the answer's ``reward`` comes back; a 5xx is retried, and a timeout, a 5xx past the
retries, malformed JSON or an answer without a numeric reward fail with a reason naming the agent server."""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from http_server import Server

from services.pool.agent_driver import AgentFailed, AgentSpec
from services.pool.agent_server import AgentServer, run_body

SEEN: list[dict] = []
HITS: dict[str, int] = {}


def agent_app() -> FastAPI:
    app = FastAPI()

    @app.post("/{mode}/run")
    async def run(mode: str, request: Request) -> Response:
        body = json.loads(await request.body())
        SEEN.append(body)
        HITS[mode] = HITS.get(mode, 0) + 1
        if mode == "http500" or mode == "flaky" and HITS[mode] == 1:
            return Response("agent crashed", status_code=500)
        if mode == "slow":
            await asyncio.sleep(3)
        if mode in ("ok", "flaky"):
            return JSONResponse({"reward": 0.5, "response": {"output": []}})
        if mode == "malformed":
            return Response("{not json", media_type="application/json")
        return JSONResponse({"reward": "high"} if mode == "wordy" else {"response": {}})

    return app


@pytest.fixture(scope="module")
def base():
    server = Server(agent_app())
    yield server.url
    server.stop()


def call(base: str, mode: str, task: dict | None = None) -> tuple[object, int]:
    spec = AgentSpec("calc", f"{base}/{mode}", "http://pool:8000/p", "secret", "tiny", 0.5, 4, 1, 0.01)

    async def go():
        server = AgentServer(spec)
        try:
            return await server.run(task or {"answer": 3}, spec.base_url, "ifr1.s.mac")
        finally:
            await server.aclose()

    return asyncio.run(go())


def test_the_run_body_and_the_reward(base):
    task = {"answer": 3, "responses_create_params": json.dumps({"input": [{"role": "user", "content": "1+2?"}]})}
    SEEN.clear()
    assert call(base, "ok", task) == (0.5, 0)
    assert SEEN == [{"answer": 3, "responses_create_params": {"input": [{"role": "user", "content": "1+2?"}]},
                     "policy_base_url": "http://pool:8000/p/v1", "policy_api_key": "ifr1.s.mac",
                     "policy_model_name": "tiny"}]
    assert run_body({"responses_create_params": "{not json"}, "http://p", "k", "m")["responses_create_params"] == \
        "{not json"  # sent as the task holds it


@pytest.mark.parametrize("mode, outcome, words", [
    ("http500", "http_5xx", "HTTP 500 after 2 attempts: agent crashed"),
    ("slow", "timeout", "timed out after 0.5s (2 attempts)"),
    ("malformed", "malformed", "answered malformed JSON"),
    ("nothing", "malformed", "answer has no field 'reward'"),
    ("wordy", "malformed", "answer field 'reward': expected a number"),
])
def test_a_failed_call_fails_with_the_reason(base, mode, outcome, words):
    with pytest.raises(AgentFailed) as err:
        call(base, mode)
    assert err.value.outcome == outcome and err.value.reason.startswith("agent server 'calc': POST /run: ")
    assert words in err.value.reason, err.value.reason


def test_a_5xx_that_a_retry_gets_past_scores(base):
    assert call(base, "flaky") == (0.5, 1) and HITS["flaky"] == 2
