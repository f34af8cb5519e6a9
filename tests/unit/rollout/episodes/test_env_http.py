"""The HTTP environment client against a real uvicorn server on 127.0.0.1: a game played to the end through
``environment_app``, and a raw app that misbehaves on purpose -- timeouts, 5xx (retried, with back-off), 4xx and
malformed answers (not retried), a refused connection, the concurrency bound -- each failing the sample with a
reason that names the environment and the endpoint, and counted."""
from __future__ import annotations

import asyncio
import json
import math
import random
import re
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from http_server import Server

from rollout.episodes.env_http import EnvCallStats, EnvironmentCallError, HttpEnvironment, HttpState
from rollout.episodes.environment import EnvStep, Message, Turn, as_async
from services.pool.env_server import environment_app

Behaviour = Callable[[str, dict, int], Awaitable[Response]]
FINAL = {"final": True} if "final" in Turn.__dataclass_fields__ else {}


class GuessNumber:
    """The game of docs/environments.md, state in JSON values."""

    def reset(self, task: dict) -> tuple[dict, list[Message]]:
        state = {"secret": int(task["secret"]), "left": 3}
        return state, [Message("user", "Guess my number between 1 and 100.")]

    def step(self, state: dict, turn: Turn) -> EnvStep:
        numbers = re.findall(r"\d+", turn.text)
        if not numbers:
            return EnvStep.more([Message("user", "Answer with a number.")])
        guess, state["left"] = int(numbers[-1]), state["left"] - 1
        if guess == state["secret"] or state["left"] == 0:
            return EnvStep.final(1.0 if guess == state["secret"] else 0.0, info={"guesses": 3 - state["left"]})
        hint = "higher" if guess < state["secret"] else "lower"
        return EnvStep.more([Message("user", f"{hint}; {state['left']} guesses left")])


class GivesUp:
    async def reset(self, task: dict) -> tuple[dict, list[Message]]:
        return {}, []

    async def step(self, state: dict, turn: Turn) -> EnvStep:
        return EnvStep.failed("sandbox crashed")


BEHAVIOURS: dict[str, Behaviour] = {}
HITS: dict[str, int] = {}
raw = FastAPI()


@raw.post("/{key}/{endpoint}")
async def misbehave(key: str, endpoint: str, request: Request) -> Response:
    HITS[key] = HITS.get(key, 0) + 1
    return await BEHAVIOURS[key](endpoint, json.loads(await request.body()), HITS[key])


@pytest.fixture(scope="module")
def base() -> Any:
    root = FastAPI()
    root.mount("/guess", environment_app(GuessNumber(), "guess"))
    root.mount("/gives-up", environment_app(GivesUp(), "gives-up"))
    root.mount("/raw", raw)
    server = Server(root)
    yield server.url
    server.stop()


def behaving(base: str, behaviour: Behaviour) -> tuple[str, str]:
    """A URL of the raw app answering with ``behaviour`` and the key its hits are counted under."""
    key = uuid.uuid4().hex[:8]
    BEHAVIOURS[key] = behaviour
    return f"{base}/raw/{key}", key


def answering(status: int, body: Any = None, text: str | None = None, ok_after: int = 0) -> Behaviour:
    """``status`` with ``body`` (JSON) or ``text``, until hit ``ok_after`` (then a good step)."""
    async def behaviour(endpoint: str, request: dict, hit: int) -> Response:
        if ok_after and hit > ok_after:
            return JSONResponse({"state": {"hit": hit}, "done": True, "reward": 1.0})
        if text is not None:
            return Response(text, status_code=status, media_type="application/json")
        return JSONResponse(body, status_code=status)
    return behaviour


run = asyncio.run


async def one_step(env: HttpEnvironment, state: HttpState | None = None) -> EnvStep:
    try:
        return await env.step(state or HttpState(None), Turn("7"))
    finally:
        await env.aclose()


def recorder() -> tuple[list[float], Callable[[float], Awaitable[None]]]:
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
    return sleeps, sleep


def consistent(stats: EnvCallStats) -> bool:
    return stats.ok + stats.failed_step + stats.failures == stats.calls


# --- a game to the end ----------------------------------------------------------------------------------------
def test_the_game_is_played_to_the_end_through_http_and_the_state_round_trips(base):
    async def play():
        async with HttpEnvironment(f"{base}/guess/", "guess", timeout_s=5) as env:
            assert await env.health() == {"status": "ok", "environment": "guess"}
            state, first = await env.reset({"secret": 42, "level": 1})
            assert first == [Message("user", "Guess my number between 1 and 100.")]
            assert state.value == {"secret": 42, "left": 3}
            steps = [await env.step(state, Turn(t, [1, 2])) for t in ("hmm", "50", "I say 42")]
            return env, state, steps

    env, state, steps = run(play())
    assert steps[0] == EnvStep.more([Message("user", "Answer with a number.")])
    assert steps[1] == EnvStep.more([Message("user", "lower; 2 guesses left")])
    assert steps[2] == EnvStep.final(1.0, info={"guesses": 2})
    assert state.value == {"secret": 42, "left": 1}
    assert env.stats.calls == env.stats.ok == 4 and env.stats.failures == 0 and env.stats.retries == 0
    assert env.stats.seconds > 0 and env.stats.in_flight == 0 and consistent(env.stats)


def test_behind_as_async_a_raising_reset_fails_the_sample_with_the_servers_reason(base):
    async def play():
        env = HttpEnvironment(f"{base}/guess", "guess", timeout_s=5, max_retries=0)
        bounded = as_async(env, 10.0)
        got = await bounded.reset({"level": 1})
        started = await bounded.reset({"secret": 3})
        assert not isinstance(started, EnvStep)
        final = await bounded.step(started[0], Turn("3"))
        await env.aclose()
        return env, got, final

    env, got, final = run(play())
    assert isinstance(got, EnvStep) and got.failure is not None and got.reward is None
    assert "POST /reset: HTTP 500 after 1 attempt: environment 'guess': reset raised KeyError: 'secret'" in got.failure
    assert got.failure.startswith("environment 'guess': ")
    assert final.reward == 1.0
    assert env.stats.http_5xx == 1 and env.stats.ok == 2 and consistent(env.stats)


def test_the_environments_own_failure_is_a_failed_step_not_retried(base):
    env = HttpEnvironment(f"{base}/gives-up", "gives-up", timeout_s=5)
    got = run(one_step(env, HttpState({})))
    assert got == EnvStep.failed("sandbox crashed")
    assert env.stats.failed_step == 1 and env.stats.ok == 0 and env.stats.retries == 0 and consistent(env.stats)


# --- retried: 5xx, timeouts, connections ----------------------------------------------------------------------
def test_a_500_then_ok_is_retried_with_exponential_back_off_and_jitter(base):
    url, key = behaving(base, answering(500, {"detail": "busy"}, ok_after=2))
    sleeps, sleep = recorder()
    env = HttpEnvironment(url, "flaky", timeout_s=5, max_retries=2, retry_backoff_s=0.1, seed=7, sleep=sleep)
    state = HttpState({"hit": 0})
    got = run(one_step(env, state))
    assert got == EnvStep.final(1.0) and state.value == {"hit": 3} and HITS[key] == 3
    rng = random.Random(7)
    assert sleeps == pytest.approx([0.1 * (0.5 + rng.random()), 0.2 * (0.5 + rng.random())])
    assert 0.05 <= sleeps[0] < 0.15 and 0.1 <= sleeps[1] < 0.3
    assert env.stats.retries == 2 and env.stats.ok == 1 and env.stats.http_5xx == 0 and consistent(env.stats)


def test_a_500_every_time_fails_after_every_attempt_with_the_body(base):
    url, key = behaving(base, answering(500, {"detail": "boom " + "x" * 300}))
    sleeps, sleep = recorder()
    env = HttpEnvironment(url, "judge", timeout_s=5, max_retries=2, retry_backoff_s=0.01, sleep=sleep)
    got = run(one_step(env))
    assert got.failure is not None and got.done and got.reward is None
    assert got.failure.startswith("environment 'judge': POST /step: HTTP 500 after 3 attempts: boom xxx")
    assert got.failure.endswith("...") and len(got.failure.split(": ", 3)[3]) == 200
    assert got.info == {"env_failure": "http_5xx"}
    assert HITS[key] == 3 and len(sleeps) == 2
    assert env.stats.http_5xx == 1 and env.stats.retries == 2 and env.stats.calls == 1 and consistent(env.stats)


def test_a_503_with_a_plain_body_is_quoted_as_text(base):
    url, _ = behaving(base, answering(503, text="no replica"))
    env = HttpEnvironment(url, "judge", timeout_s=5, max_retries=0)
    assert run(one_step(env)).failure == "environment 'judge': POST /step: HTTP 503 after 1 attempt: no replica"


def test_an_answer_past_the_deadline_times_out_on_every_attempt(base):
    async def slow(endpoint: str, request: dict, hit: int) -> Response:
        await asyncio.sleep(5.0)
        return JSONResponse({"state": {}, "done": True, "reward": 1.0})

    url, key = behaving(base, slow)
    env = HttpEnvironment(url, "slow", timeout_s=0.2, max_retries=1, retry_backoff_s=0.0)
    t0 = time.monotonic()
    got = run(one_step(env))
    assert time.monotonic() - t0 < 4.0  # two answers in full would take 10 s; two deadlines 0.4 s (slack: a loaded machine)
    assert got.failure == "environment 'slow': POST /step: timed out after 0.2s (2 attempts)"
    assert HITS[key] == 2 and env.stats.timeout == 1 and env.stats.retries == 1 and consistent(env.stats)


def test_a_refused_connection_is_retried_then_fails_and_reset_raises():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    sleeps, sleep = recorder()
    env = HttpEnvironment(f"http://127.0.0.1:{port}", "gone", timeout_s=2, max_retries=1, sleep=sleep)

    async def call():
        try:
            await env.reset({"secret": 1})
        finally:
            await env.aclose()

    with pytest.raises(EnvironmentCallError, match=r"^environment 'gone': POST /reset: connection failed after 2 "
                                                   r"attempts: ConnectError") as err:
        run(call())
    assert err.value.kind == "connection" and len(sleeps) == 1
    assert env.stats.connection == 1 and env.stats.retries == 1 and consistent(env.stats)


# --- not retried: 4xx and malformed answers -------------------------------------------------------------------
def test_a_4xx_fails_at_once(base):
    url, key = behaving(base, answering(404, {"detail": "no such route"}))
    env = HttpEnvironment(url, "judge", timeout_s=5, max_retries=3)
    assert run(one_step(env)).failure == "environment 'judge': POST /step: HTTP 404: no such route"
    assert HITS[key] == 1 and env.stats.http_4xx == 1 and env.stats.retries == 0 and consistent(env.stats)


@pytest.mark.parametrize(("body", "reason"), [
    ('{"state": {}, "done": tru', "answered malformed JSON (Expecting value: line 1 column 23 (char 22)): "
                                  "'{\"state\": {}, \"done\": tru'"),
    ("[1, 2]", "answered [1, 2], expected a JSON object"),
    ('{"done": true, "reward": 1}', "answer has no field 'state' (fields: ['done', 'reward'])"),
    ('{"state": {}, "reward": 1}', "answer has no field 'done' (fields: ['reward', 'state'])"),
    ('{"state": {}, "done": true, "reward": "x"}', "answer field 'reward': expected a number or null, got 'x'"),
    ('{"state": {}, "done": 1, "reward": 1}', "answer field 'done': expected true or false, got 1"),
    ('{"state": {}, "done": false, "observation": [{"role": "bot", "content": "hi"}]}',
     "answer field 'observation[0].role': expected one of ['system', 'user', 'assistant', 'tool'], got 'bot'"),
    ('{"state": {}, "done": false, "observation": [{"role": "user", "content": 3}]}',
     "answer field 'observation[0].content': expected a string, got 3"),
    ('{"state": {}, "done": true, "reward": 1, "components": {"a": "1"}}',
     "answer field 'components.a': expected a number, got '1'"),
    ('{"state": {}, "done": true, "reward": 1, "info": {"a": [1]}}',
     "answer field 'info.a': expected a string or a number, got [1]"),
    ('{"state": {}, "done": false, "reward": 1}', "answered an invalid step: EnvStep.reward: only a done step has a "
                                                  "reward"),
    ('{"state": {}, "done": false, "failure": "x"}', "answered an invalid step: EnvStep: a failed step is done, with "
                                                     "no reward and no observation"),
])
def test_a_malformed_answer_fails_at_once_with_what_is_wrong(base, body, reason):
    url, key = behaving(base, answering(200, text=body))
    env = HttpEnvironment(url, "judge", timeout_s=5, max_retries=3)
    state = HttpState({"kept": True})
    assert run(one_step(env, state)).failure == f"environment 'judge': POST /step: {reason}"
    assert state.value == {"kept": True}  # a malformed answer does not touch the state
    assert HITS[key] == 1 and env.stats.malformed == 1 and env.stats.retries == 0 and consistent(env.stats)


def test_reset_answers_are_checked_too(base):
    url, _ = behaving(base, answering(200, {"state": 1, "messages": [{"role": "user", "content": "a", "name": 2}]}))
    env = HttpEnvironment(url, "judge", timeout_s=5)
    with pytest.raises(EnvironmentCallError, match=r"POST /reset: answer field 'messages\[0\].name': expected a "
                                                   r"string or null, got 2"):
        run(env.reset({}))


# --- the request ----------------------------------------------------------------------------------------------
def test_the_request_carries_the_state_and_the_turn_with_final(base):
    seen: list[dict] = []

    async def echo(endpoint: str, request: dict, hit: int) -> Response:
        seen.append({"endpoint": endpoint, **request})
        if endpoint == "reset":
            return JSONResponse({"state": {"n": 0}, "messages": [{"role": "system", "content": "go",
                                                                   "tool_call_id": "c1"}]})
        return JSONResponse({"state": {"n": request["state"]["n"] + 1}, "done": False,
                             "observation": [{"role": "tool", "content": "7", "name": "calc"}],
                             "info": {"tool_calls": 1}})

    url, _ = behaving(base, echo)

    async def play():
        import numpy as np

        async with HttpEnvironment(url, "echo", timeout_s=5) as env:
            state, first = await env.reset({"secret": np.int64(4), "xs": np.arange(2)})
            step = await env.step(state, Turn("hi", (5, 6), **FINAL))
            return state, first, step

    state, first, step = run(play())
    assert first == [Message("system", "go", tool_call_id="c1")]
    assert step == EnvStep.more([Message("tool", "7", name="calc")], {"tool_calls": 1})
    assert state.value == {"n": 1}
    assert seen[0] == {"endpoint": "reset", "task": {"secret": 4, "xs": [0, 1]}}
    assert seen[1] == {"endpoint": "step", "state": {"n": 0},
                       "turn": {"text": "hi", "token_ids": [5, 6], "final": bool(FINAL)}}


def test_a_task_that_is_not_json_fails_before_any_request_and_step_wants_the_state_reset_gave():
    env = HttpEnvironment("http://127.0.0.1:9", "judge")
    with pytest.raises(EnvironmentCallError, match=r"POST /reset: request is not JSON-serializable: .*set") as err:
        run(env.reset({"s": {1, 2}}))
    assert err.value.kind == "malformed" and env.stats.malformed == 1
    with pytest.raises(EnvironmentCallError, match="Out of range float values"):
        run(env.reset({"x": math.nan}))
    with pytest.raises(TypeError, match="expected the HttpState that reset gave, got dict"):
        run(env.step({"a": 1}, Turn("x")))  # pyright: ignore[reportArgumentType]


# --- bounds ---------------------------------------------------------------------------------------------------
def test_no_more_than_max_concurrent_calls_are_in_flight(base):
    now, three = {"in": 0, "max": 0}, asyncio.Event()  # the first ones wait (up to 1s) for a third to come

    async def busy(endpoint: str, request: dict, hit: int) -> Response:
        now["in"] += 1
        now["max"] = max(now["max"], now["in"])
        if now["in"] >= 3:
            three.set()
        await asyncio.wait([asyncio.ensure_future(three.wait())], timeout=1.0)
        await asyncio.sleep(0.05)
        now["in"] -= 1
        return JSONResponse({"state": {}, "done": True, "reward": 0.5})

    url, key = behaving(base, busy)

    async def many():
        async with HttpEnvironment(url, "busy", timeout_s=5, max_concurrent_calls=3) as env:
            steps = await asyncio.gather(*(env.step(HttpState({}), Turn(str(i))) for i in range(10)))
            return env, steps

    env, steps = run(many())
    assert all(s == EnvStep.final(0.5) for s in steps) and HITS[key] == 10
    assert now["max"] == 3 and env.stats.max_in_flight == 3 and env.stats.in_flight == 0
    assert env.stats.ok == 10 and consistent(env.stats)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"name": ""}, "name: expected a non-empty string"),
    ({"url": "127.0.0.1:8300"}, "url: expected http://"),
    ({"timeout_s": 0}, "timeout_s: expected a finite number > 0, got 0"),
    ({"timeout_s": math.inf}, "timeout_s: expected a finite number > 0, got inf"),
    ({"max_concurrent_calls": 0}, "max_concurrent_calls: expected an integer >= 1, got 0"),
    ({"max_concurrent_calls": 2.0}, "max_concurrent_calls: expected an integer >= 1, got 2.0"),
    ({"max_retries": -1}, "max_retries: expected an integer >= 0, got -1"),
    ({"retry_backoff_s": math.nan}, "retry_backoff_s: expected a finite number >= 0, got nan"),
])
def test_the_constructor_refuses_bad_bounds(kwargs, match):
    args = {"url": "http://127.0.0.1:8300", "name": "judge", **kwargs}
    with pytest.raises(ValueError, match=re.escape(match)):
        HttpEnvironment(**args)


def test_stats_snapshot_names_every_counter_and_health_names_the_environment():
    env = HttpEnvironment("http://127.0.0.1:9", "judge", timeout_s=1)
    env.stats.calls, env.stats.timeout, env.stats.seconds = 2, 1, 0.5
    snap = env.snapshot()
    assert snap == {"calls": 2.0, "ok": 0.0, "failed_step": 0.0, "timeout": 1.0, "http_5xx": 0.0, "http_4xx": 0.0,
                    "malformed": 0.0, "connection": 0.0, "retries": 0.0, "seconds": 0.5, "in_flight": 0.0,
                    "max_in_flight": 0.0}
    assert env.stats.failures == 1
    with pytest.raises(EnvironmentCallError, match=r"^environment 'judge': GET /healthz: ConnectError"):
        run(env.health())


