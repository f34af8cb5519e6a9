"""The environment server app (services.pool.env_server.environment_app) through FastAPI's TestClient: plain
and async environments, the state round trip, 422 naming the body field, 500 naming the environment for an
exception, a wrong answer or a state that is not JSON; loading an environment by path; the CLI entry."""
from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from rollout.episodes.environment import EnvStep, Message, Turn
from services.pool import env_server
from services.pool.env_server import build_environment_object, environment_app, serve_environment_main

HAS_FINAL = "final" in {f.name for f in dataclasses.fields(Turn)}


class Counter:
    """Plain methods; the state is a dict changed in place."""

    def __init__(self, limit: int = 2):
        self.limit = limit
        self.turns: list[Turn] = []

    def reset(self, task: dict) -> tuple[dict, list[Message]]:
        return {"n": 0, "task": task}, [Message("user", f"count to {self.limit}")]

    def step(self, state: dict, turn: Turn) -> EnvStep:
        self.turns.append(turn)
        state["n"] += 1
        if state["n"] >= self.limit:
            return EnvStep.final(float(state["n"]), {"count": 1.0}, {"turns": state["n"]})
        return EnvStep.more([Message("tool", str(state["n"]), name="count", tool_call_id="c")])


class AsyncBroken:
    """``async`` methods that go wrong in each way the server reports."""

    async def reset(self, task: dict):
        if task.get("bad") == "state":
            return {1, 2}, []
        if task.get("bad") == "answer":
            return [{}, []]
        return {"ok": True}, []

    async def step(self, state: dict, turn: Turn):
        if turn.text == "raise":
            raise KeyError("secret")
        if turn.text == "float":
            return 0.0
        return EnvStep.failed("sandbox crashed")


@pytest.fixture
def counter():
    env = Counter()
    return env, TestClient(environment_app(env, "counter"))


def test_healthz_names_the_environment(counter):
    _, client = counter
    assert client.get("/healthz").json() == {"status": "ok", "environment": "counter"}


def test_reset_and_step_round_trip_the_state(counter):
    env, client = counter
    got = client.post("/reset", json={"task": {"level": 1}}).json()
    assert got == {"state": {"n": 0, "task": {"level": 1}}, "messages": [{"role": "user", "content": "count to 2"}]}
    first = client.post("/step", json={"state": got["state"], "turn": {"text": "one", "token_ids": [1, 2]}}).json()
    assert first == {"state": {"n": 1, "task": {"level": 1}}, "done": False, "reward": None, "components": {},
                     "info": {}, "failure": None,
                     "observation": [{"role": "tool", "content": "1", "name": "count", "tool_call_id": "c"}]}
    last = client.post("/step", json={"state": first["state"], "turn": {"text": "two", "final": True}}).json()
    assert last == {"state": {"n": 2, "task": {"level": 1}}, "done": True, "reward": 2.0, "components": {"count": 1.0},
                    "info": {"turns": 2}, "failure": None, "observation": []}
    assert env.turns[0].token_ids == (1, 2) and env.turns[1].token_ids == ()
    if HAS_FINAL:
        assert [getattr(t, "final", None) for t in env.turns] == [False, True]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/reset", {}, "task"),
    ("/reset", {"task": [1]}, "task"),
    ("/step", {"turn": {"text": "x"}}, "state"),
    ("/step", {"state": {}, "turn": {"text": 3}}, "turn.text"),
    ("/step", {"state": {}, "turn": {"text": "x", "token_ids": ["1"]}}, "turn.token_ids.0"),
    ("/step", {"state": {}, "turn": {"text": "x", "final": "yes"}}, "turn.final"),
])
def test_a_body_that_is_not_the_protocols_is_a_422_naming_the_field(counter, path, body, field):
    _, client = counter
    got = client.post(path, json=body)
    assert got.status_code == 422
    assert got.json()["detail"].startswith(f"environment 'counter': POST {path}: body field {field!r}: ")


def test_a_body_that_is_not_json_is_a_422(counter):
    _, client = counter
    got = client.post("/step", content=b"{nope", headers={"content-type": "application/json"})
    assert got.status_code == 422 and "JSON decode error" in got.json()["detail"]


@pytest.mark.parametrize(("path", "body", "detail"), [
    ("/step", {"state": {}, "turn": {"text": "raise"}}, "environment 'broken': step raised KeyError: 'secret'"),
    ("/step", {"state": {}, "turn": {"text": "float"}}, "environment 'broken': step returned float 0.0, "
                                                         "expected an EnvStep"),
    ("/reset", {"task": {"bad": "answer"}}, "environment 'broken': reset returned list [{}, []], expected "
                                            "(state, list[Message])"),
    ("/reset", {"task": {"bad": "state"}}, "environment 'broken': reset left a state of type set that is not JSON "
                                           "(Object of type set is not JSON serializable); an environment served "
                                           "over HTTP keeps its state in JSON values (dicts, lists, strings, "
                                           "numbers)"),
])
def test_what_goes_wrong_in_the_environment_is_a_500_naming_it(path, body, detail):
    client = TestClient(environment_app(AsyncBroken(), "broken"))
    got = client.post(path, json=body)
    assert got.status_code == 500 and got.json() == {"detail": detail}


def test_the_environments_own_failure_is_an_answer():
    client = TestClient(environment_app(AsyncBroken(), "broken"))
    got = client.post("/step", json={"state": None, "turn": {"text": "x"}})
    assert got.status_code == 200
    assert got.json() == {"state": None, "observation": [], "done": True, "reward": None, "components": {},
                          "info": {}, "failure": "sandbox crashed"}


def test_environment_app_refuses_what_is_not_an_environment():
    with pytest.raises(TypeError, match="environment 'x': object has no method reset"):
        environment_app(object(), "x")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="name: expected a non-empty string"):
        environment_app(Counter(), "")


ENV_FILE = """
from rollout.episodes.environment import EnvStep

class Fixed:
    def __init__(self, reward):
        self.reward = reward
    def reset(self, task):
        return {}, []
    def step(self, state, turn):
        return EnvStep.final(self.reward)
"""


def test_an_environment_is_built_from_a_file_with_its_kwargs(tmp_path):
    path = tmp_path / "fixed_env.py"
    path.write_text(ENV_FILE)
    env = build_environment_object(f"{path}:Fixed", {"reward": 0.25}, "fixed")
    assert env.reward == 0.25
    with pytest.raises(ValueError, match=r"environment 'fixed': .*:Fixed\(\*\*kwargs\) failed: TypeError"):
        build_environment_object(f"{path}:Fixed", {"rewrd": 1}, "fixed")
    with pytest.raises(ValueError, match="has no class 'Nope'"):
        build_environment_object(f"{path}:Nope", {}, "fixed")


def test_the_cli_serves_the_environment_with_uvicorn(tmp_path, monkeypatch, capsys):
    import uvicorn

    path = tmp_path / "fixed_env.py"
    path.write_text(ENV_FILE)
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    assert serve_environment_main([f"{path}:Fixed", "--port", "8311", "--kwargs", '{"reward": 1}']) == 0
    assert (seen["host"], seen["port"], seen["log_level"]) == ("127.0.0.1", 8311, "info")
    client = TestClient(seen["app"])
    assert client.get("/healthz").json() == {"status": "ok", "environment": "Fixed"}
    assert client.post("/step", json={"state": {}, "turn": {"text": ""}}).json()["reward"] == 1.0
    assert serve_environment_main([f"{path}:Fixed", "--kwargs", "[1]"]) == 2
    assert "--kwargs: expected a JSON object, got list" in capsys.readouterr().err
    assert serve_environment_main([f"{path}:Fixed", "--kwargs", "{}"]) == 2
    assert "Fixed(**kwargs) failed: TypeError" in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"name": "a b"}, "name: expected 1-64 of"),
    ({"route_prefix": "/"}, "route_prefix: expected '/<path>'"),
    ({"route_prefix": "env/x"}, "route_prefix: expected '/<path>'"),
    ({"route_prefix": "/env/x/"}, "route_prefix: expected '/<path>'"),
    ({"num_replicas": 0}, "num_replicas: expected an integer >= 1"),
])
def test_deploy_environment_checks_its_arguments_before_touching_serve(kwargs, match):
    args = {"name": "judge", "environment_path": "m:C", **kwargs}
    with pytest.raises(ValueError, match=match):
        env_server.deploy_environment(**args)
