"""A rollout pool whose episodes are played by an environment server (``env.<name>.url``): a server that times
out, answers HTTP 500 or malformed JSON fails each of its samples with the reason (never reward 0), a 500 that
a retry gets past still scores, the pool keeps serving, and ``/metrics`` counts every outcome per environment."""
from __future__ import annotations

import asyncio
import time
import urllib.request
import uuid

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from http_server import Server

GROUP = 2
ENV = "judge"
SEEN: set[str] = set()
"""Episodes whose first step was answered with a 500 (the ``flaky`` mode)."""


def judge_app() -> FastAPI:
    """The environment server: one step per episode; what it does is the task's ``mode``."""
    app = FastAPI()

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.post("/reset")
    async def reset(request: Request):
        task = (await request.json())["task"]
        return {"state": {"mode": task["mode"], "id": uuid.uuid4().hex}, "messages": []}

    @app.post("/step")
    async def step(request: Request) -> Response:
        body = await request.json()
        state, mode = body["state"], body["state"]["mode"]
        if mode == "timeout":
            await asyncio.sleep(5)
        if mode == "http500" or (mode == "flaky" and state["id"] not in SEEN):
            SEEN.add(state["id"])
            return Response("judge overloaded", status_code=500)
        if mode == "malformed":
            return Response("{not json", media_type="application/json")
        reward = min(1.0, len(body["turn"]["token_ids"]) / 8)
        return JSONResponse({"state": state, "observation": [], "done": True, "reward": reward,
                             "components": {}, "info": {}, "failure": None})

    return app


@pytest.fixture(scope="module")
def judge():
    server = Server(judge_app())
    yield server.url
    server.stop()


def test_environment_server_failures_fail_their_samples_and_the_pool_goes_on(ray_cluster, judge, tmp_path):
    from protocol import ControlMessage, PromptRequest, TrajectoryGroup, decode, encode
    from services import pool as pool_api
    from services.app import deploy_pool
    from services.job.channel import TrajectoryChannel
    from services.recipe.config import load_recipe

    recipe = load_recipe(None, [
        "rollout_pool.name=inflight-env-server-pool", "rollout_pool.route_prefix=/env-server-pool",
        "grpo.num_prompts_per_step=2",
        f"grpo.num_generations_per_prompt={GROUP}", "policy.generation.max_new_tokens=8",
        f"env.{ENV}.url={judge}", f"env.{ENV}.step_timeout_s=1", f"env.{ENV}.max_retries=1",
        f"env.{ENV}.retry_backoff_s=0.05", "logger.tensorboard_enabled=false"])
    deployed = deploy_pool(recipe, tmp_path)
    pool = pool_api.connect(recipe.rollout_pool.name)
    learner_id = f"env-server-{uuid.uuid4().hex[:8]}"
    channel = TrajectoryChannel.create(f"{learner_id}-trajectories", 16)

    def play(modes: list[str]) -> dict[str, TrajectoryGroup]:
        requests = [PromptRequest(f"{mode}-{uuid.uuid4().hex[:6]}", np.arange(5, 15), {"mode": mode})
                    for mode in modes]
        pool.submit.remote([encode(r) for r in requests], GROUP).result(timeout_s=120)
        groups: dict[str, TrajectoryGroup] = {}
        deadline = time.monotonic() + 240
        while len(groups) < len(requests) and time.monotonic() < deadline:
            msg = decode(channel.recv(max(1.0, deadline - time.monotonic())))
            assert not isinstance(msg, ControlMessage), msg
            assert isinstance(msg, TrajectoryGroup)
            groups[msg.prompt_id.split("-")[0]] = msg
        return groups

    try:
        pool.attach.remote(learner_id, channel).result(timeout_s=60)
        failing = play(["timeout", "http500", "malformed", "ok"])
        after = play(["ok", "flaky"])  # the pool still serves, and a retry gets past one 500
        want = f'inflight_env_failed_samples_total{{env="{ENV}"}} {3.0 * GROUP}'
        deadline, metrics = time.monotonic() + 60, ""
        while want not in metrics and time.monotonic() < deadline:  # the watcher folds engine stats in each period
            metrics = urllib.request.urlopen(f"{deployed.http}/metrics", timeout=30).read().decode()
            time.sleep(1)
    finally:
        pool.detach.remote(learner_id).result(timeout_s=60)
        channel.close()
        pool_api.shutdown(recipe.rollout_pool.name)
    expected = {"timeout": "timed out after 1s", "http500": "HTTP 500 after 2 attempts",
                "malformed": "malformed JSON"}
    for mode, words in expected.items():
        for t in failing[mode].trajectories:
            assert t.finish_reason == "error" and t.reward is None, (mode, t)
            assert f"environment '{ENV}'" in t.error and words in t.error, (mode, t.error)
    for groups in (failing, after):
        for t in groups["ok"].trajectories:
            assert t.ok and t.reward == min(1.0, len(t.response_ids) / 8), t.error
    assert all(t.ok for t in after["flaky"].trajectories), [t.error for t in after["flaky"].trajectories]
    for outcome in ("timeout", "http_5xx", "malformed", "ok"):
        assert f'inflight_env_calls_total{{env="{ENV}",outcome="{outcome}"}}' in metrics, outcome
    assert want in metrics, metrics
    assert f'inflight_env_retries_total{{env="{ENV}"}}' in metrics
    from grafana_names import dashboard_names, missing  # every metric the Grafana dashboard queries is served

    assert missing(dashboard_names(), metrics) == []
