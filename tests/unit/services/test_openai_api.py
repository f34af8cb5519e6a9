"""The pool's OpenAI-compatible ingress checks (services/pool/openai_api.py): keys, bodies, error shapes; and the
recipe keys that turn the endpoint on (``policy.generation.vllm_cfg``)."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from rollout.config import ServingChatKwargs, VllmConfig
from services.pool.openai_api import (
    ChatBody,
    ChatLimits,
    OpenAIError,
    SessionRoutes,
    check_chat_body,
    check_key,
    check_session,
    model_list,
    rollout_key,
    rollout_key_secret,
    serving_key,
)

LIMITS = ChatLimits(max_model_len=1024)
MESSAGES = [{"role": "user", "content": "hi"}]


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode()


def refusal(raw: bytes, limits: ChatLimits = LIMITS) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        check_chat_body(raw, limits)
    return err.value


def test_a_good_body():
    assert check_chat_body(body(), LIMITS) == ChatBody(stream=False, n=1)
    assert check_chat_body(body(stream=True, n=3, max_tokens=1024, tools=[]), LIMITS) == ChatBody(True, 3)


@pytest.mark.parametrize(("raw", "status", "param", "words"), [
    (b"{not json", 400, None, "not JSON"),
    (b"\xff\xfe", 400, None, "not JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    (json.dumps({"messages": MESSAGES}).encode(), 400, "model", "model: required"),
    (json.dumps({"model": "m"}).encode(), 400, "messages", "non-empty list"),
    (body(messages=[]), 400, "messages", "non-empty list"),
    (body(messages=["hi"]), 400, "messages", "message objects"),
    (body(stream="yes"), 400, "stream", "boolean"),
    (body(n=0), 400, "n", "1..64"),
    (body(n=65), 400, "n", "1..64"),
    (body(n=True), 400, "n", "integer"),
    (body(n=2.0), 400, "n", "integer"),
    (body(max_tokens=1025), 400, "max_tokens", "1..1024"),
    (body(max_completion_tokens=0), 400, "max_completion_tokens", "1..1024"),
])
def test_refusals_name_the_field(raw, status, param, words):
    err = refusal(raw)
    assert (err.status, err.param) == (status, param) and words in err.message
    assert err.body() == {"error": {"message": err.message, "type": "BadRequestError", "param": param,
                                    "code": status}}


def test_a_body_over_the_bound():
    err = refusal(body(), ChatLimits(max_model_len=1024, max_body_bytes=10))
    assert err.status == 413 and "at most 10" in err.message


def test_keys():
    key = serving_key("admin")
    assert key != "admin" and len(key) == 64 and key == serving_key("admin") != serving_key("other")
    for good in (f"Bearer {key}", f"bearer {key}", "Bearer admin"):
        check_key(good, "admin")
    for bad in (None, "", key, f"Basic {key}", "Bearer ", f"Bearer {serving_key('other')}", "Bearer adm"):
        with pytest.raises(OpenAIError) as err:
            check_key(bad, "admin")
        assert err.value.status == 401 and err.value.body()["error"]["type"] == "AuthenticationError"


def test_a_rollout_key_binds_its_session_and_nothing_else():
    secret = rollout_key_secret("admin")
    assert secret not in (serving_key("admin"), "admin") and secret == rollout_key_secret("admin")
    key = rollout_key(secret, "pool-engine-0:abc.1")
    assert check_key(f"Bearer {key}", "admin") == "pool-engine-0:abc.1"
    assert check_key(f"Bearer {serving_key('admin')}", "admin") is None
    forged = [rollout_key(secret, "other") .replace("other", "pool-engine-0:abc.1"),  # another session's MAC
              rollout_key(rollout_key_secret("other-admin"), "pool-engine-0:abc.1"), "ifr1.", "ifr1..x",
              key[:-1] + ("0" if key[-1] != "0" else "1")]
    for bad in forged:
        with pytest.raises(OpenAIError) as err:
            check_key(f"Bearer {bad}", "admin")
        assert err.value.status == 401, bad
    assert check_session(None, "s1") == "s1" and check_session("s1", "s1") == "s1"
    with pytest.raises(OpenAIError) as err:
        check_session("s2", "s1")
    assert err.value.status == 403 and err.value.param == "x-inflight-session"


def test_session_routes_keep_a_session_on_one_engine():
    routes = SessionRoutes(max_routes=2)
    serving, up = ["e0", "e1"], ["e0", "e1", "e2"]
    assert [routes.engine_for(None, serving, up) for _ in range(3)] == ["e0", "e1", "e0"]  # round robin
    first = routes.engine_for("a", serving, up)
    assert all(routes.engine_for("a", serving, up) == first for _ in range(4))
    assert routes.engine_for("e2:x", serving, up) == "e2"  # the driver's sessions: their engine, up at any version
    assert routes.engine_for("e9:x", serving, up) in serving  # an engine that is not up: like any session
    other = "e1" if first == "e0" else "e0"
    assert routes.engine_for("a", [other], up) == other  # its engine stopped serving: moved, and kept there
    assert routes.engine_for("a", serving, up) == other
    routes.engine_for("b", serving, up), routes.engine_for("c", serving, up)  # "a" is the oldest: forgotten
    assert "a" not in routes._routes and len(routes._routes) == 2
    assert routes.engine_for("a", [], up) is None


def test_model_list():
    out = model_list("tiny://qwen2", 1024, 7, 100)
    assert out["object"] == "list" and [m["id"] for m in out["data"]] == ["tiny://qwen2"]
    assert out["data"][0]["policy_version"] == 7 and out["data"][0]["max_model_len"] == 1024


def test_recipe_keys():
    cfg = VllmConfig.model_validate({"expose_http_server": True, "http_server_serving_chat_kwargs": {
        "enable_auto_tools": True, "tool_parser": "hermes", "reasoning_parser": "qwen3"}})
    assert cfg.expose_http_server and cfg.http_server_serving_chat_kwargs.tool_parser == "hermes"
    assert not VllmConfig().expose_http_server and VllmConfig().http_server_serving_chat_kwargs == ServingChatKwargs()
    with pytest.raises(ValidationError, match="enable_auto_tools needs tool_parser"):
        ServingChatKwargs(enable_auto_tools=True)
    with pytest.raises(ValidationError):
        ServingChatKwargs(tool_parser="no spaces or ; allowed")


def test_session_ids():
    assert check_session(None) is None and check_session("run-3:episode_17.a") == "run-3:episode_17.a"
    for bad in ("", "has space", "x" * 129, "semi;colon", "é"):
        with pytest.raises(OpenAIError) as err:
            check_session(bad)
        assert err.value.status == 400 and err.value.param == "x-inflight-session"


def test_chat_places_refuse_when_full_and_count_every_place_given_back():
    import asyncio

    from prometheus_client import CollectorRegistry, Counter, Gauge

    from services.pool.openai_api import ChatPlaces

    registry = CollectorRegistry()
    places = ChatPlaces(2, Gauge("running", "", registry=registry), Counter("answered", "", ["outcome"],
                                                                             registry=registry))

    async def scenario() -> None:
        await places.take()
        await places.take()
        with pytest.raises(OpenAIError) as full:
            places.refuse_if_full()
        assert full.value.status == 429 and full.value.type == "RateLimitError"
        assert registry.get_sample_value("running") == 2
        places.give_back("hung_up")
        places.refuse_if_full()  # a place is free again
        places.give_back("ok")
        await places.take()
        places.give_back("engine_error")
        await places.take()
        await places.take()
        waiting = asyncio.create_task(places.take())  # an agent's call waits for a place instead of a 429
        await asyncio.sleep(0.01)
        assert not waiting.done()
        places.give_back("ok")
        await asyncio.wait_for(waiting, 1)
        places.give_back("ok")
        places.give_back("ok")

    asyncio.run(scenario())
    assert registry.get_sample_value("running") == 0
    assert {o: registry.get_sample_value("answered_total", {"outcome": o}) for o in ("ok", "engine_error", "hung_up")} \
        == {"ok": 4, "engine_error": 1, "hung_up": 1}
