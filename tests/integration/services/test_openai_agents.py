"""Agents through a live CPU pool (issue 38, items 3-4): the pool's section is an agent server in NeMo-Gym's shape
(tests/integration/services/openai_pool.py), whose episodes, played through the pool with rollout keys, become
groups whose trained ids are the ids the agent was served; a server that times out, answers 500 or malformed JSON
fails its samples with the reason and the pool goes on. The example agent server of recipes/agents/ plays the
letter relay through the same pool. A push between two calls of a session gives their tokens v, then v+1."""
from __future__ import annotations

import time
import urllib.request
import uuid

import httpx
import numpy as np
from http_server import Server
from openai_pool import AGENT_TIMEOUT_S, POOL_NAME, SERVED_IDS, TOKEN

from services.pool.openai_api import serving_key


def test_an_agent_servers_episodes_become_groups_and_its_failures_fail_their_samples(served):
    """Issue 38, item 3, through the real pool: each sample is an agent episode (two calls, the first answer
    appended as text) in a session of its own; the trained ids are exactly the ids the agent was served, the
    environment's tokens between are masked; a server that times out, answers 500 or malformed JSON fails its
    samples with the reason, and the pool goes on."""
    from protocol import ControlMessage, PromptRequest, TrajectoryGroup, decode, encode
    from services import pool as pool_api
    from services.job.channel import TrajectoryChannel

    _, url, _ = served
    handle = pool_api.connect(POOL_NAME)
    learner_id = f"agents-{uuid.uuid4().hex[:8]}"
    channel = TrajectoryChannel.create(f"{learner_id}-trajectories", 16)
    modes = ["ok", "timeout", "http500", "malformed"]
    requests = [PromptRequest(f"{mode}-{uuid.uuid4().hex[:6]}", np.arange(5, 15), {"mode": mode, "key": mode})
                for mode in modes]
    groups: dict[str, TrajectoryGroup] = {}
    try:
        handle.attach.remote(learner_id, channel).result(timeout_s=60)
        handle.submit.remote([encode(r) for r in requests], 1).result(timeout_s=60)
        deadline = time.monotonic() + 180
        while len(groups) < len(modes) and time.monotonic() < deadline:
            msg = decode(channel.recv(max(1.0, deadline - time.monotonic())))
            assert isinstance(msg, TrajectoryGroup) and not isinstance(msg, ControlMessage), msg
            groups[msg.prompt_id.split("-")[0]] = msg
    finally:
        handle.detach.remote(learner_id).result(timeout_s=60)
        channel.close()
    (ok,) = groups["ok"].trajectories
    assert ok.ok and ok.reward == 0.25, ok.error
    sampled = ok.response_ids[ok.loss_mask == 1].tolist()
    assert sampled == SERVED_IDS["ok"][0] + SERVED_IDS["ok"][1]  # byte for byte what the engine served
    first = len(SERVED_IDS["ok"][0])
    assert ok.response_ids[:first].tolist() == SERVED_IDS["ok"][0] and (ok.loss_mask[first:] == 0).any()
    expected = {"timeout": f"timed out after {AGENT_TIMEOUT_S}s", "http500": "HTTP 500 after 1 attempt: agent crashed",
                "malformed": "malformed JSON"}
    for mode, words in expected.items():
        (t,) = groups[mode].trajectories
        assert not t.ok and t.reward is None and t.failure_kind == "environment", (mode, t)
        assert "agent server 'agents': POST /run" in t.error and words in t.error, (mode, t.error)
    want = 'inflight_env_calls_total{env="agents",outcome="timeout"} 1.0'
    deadline, metrics = time.monotonic() + 60, ""
    while want not in metrics and time.monotonic() < deadline:  # the watcher folds engine stats in each period
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
        time.sleep(1)
    for outcome in ("ok", "timeout", "http_5xx", "malformed"):
        assert f'inflight_env_calls_total{{env="agents",outcome="{outcome}"}} 1.0' in metrics, outcome
    assert 'inflight_env_failed_samples_total{env="agents"} 3.0' in metrics


def test_the_example_agent_server_plays_the_relay_through_the_pool(served):
    """recipes/agents/agent_server.py serving recipes/agents/letter_relay_agent.py (neither imports Inflight) plays
    one episode through the live pool from a NeMo-Gym-shaped ``/run`` body; a body without the model endpoint is
    a 422."""
    import importlib.util
    from pathlib import Path

    recipe, url, _ = served
    root = Path(__file__).resolve().parents[3] / "recipes" / "agents"
    spec = importlib.util.spec_from_file_location("agent_server_example", root / "agent_server.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    server = Server(example.make_app(example.load_run(str(root / "letter_relay_agent.py"))))
    try:
        body = {"letters": "i,o", "policy_base_url": f"{url}/v1", "policy_api_key": serving_key(TOKEN),
                "policy_model_name": recipe.policy.model_name}
        answer = httpx.post(f"{server.url}/run", json=body, timeout=120)
        assert answer.status_code == 200 and 0.0 <= answer.json()["reward"] <= 1.0, answer.text
        assert httpx.post(f"{server.url}/run", json={"letters": "i"}, timeout=30).status_code == 422
    finally:
        server.stop()


def test_a_push_between_two_calls_gives_v_then_v_plus_1(served):
    """Token capture through the real engine: a session's first answer is sampled at the pool's version, a push
    lands, and the next answer's tokens carry the new version; the trajectory keeps each token's version (the
    pool is put back at its version afterwards: the serving tests expect 0)."""
    from model_weights import model_tensors
    from test_faults import bucket_refs

    from protocol import encode, pack_buckets
    from services import pool as pool_api
    from services.models.source import resolve_model
    from services.pool.session_episode import session_episode

    recipe, _, client = served
    handle = pool_api.connect(POOL_NAME)
    model, session = recipe.policy.model_name, {"x-inflight-session": f"push-{uuid.uuid4().hex[:6]}"}
    messages = [{"role": "user", "content": "Say hello."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=4, logprobs=True,
                                           extra_headers=session)
    version = first.model_extra["policy_versions"][0][0]["version"]
    manifest, buckets = pack_buckets(list(model_tensors(resolve_model(model))), version + 1, 1 << 20)
    try:
        assert handle.push.remote(encode(manifest), bucket_refs(buckets)).result(timeout_s=300).version == version + 1
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Again."}]
        client.chat.completions.create(model=model, messages=messages, max_tokens=4, extra_headers=session)
        episode = session_episode(handle.take_session.remote(session["x-inflight-session"]).result(timeout_s=30), 1.0)
    finally:
        back, back_buckets = pack_buckets(list(model_tensors(resolve_model(model))), version, 1 << 20)
        handle.push.remote(encode(back), bucket_refs(back_buckets), reset=True).result(timeout_s=300)
    t = episode.trajectory
    sampled = t.sampled_versions.tolist()
    assert set(sampled) == {version, version + 1} and sampled == sorted(sampled), sampled
    assert sampled.count(version) == len(first.choices[0].logprobs.content)  # the first answer's tokens, all of v
