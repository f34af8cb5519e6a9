"""An environment deployed as its own Ray Serve application (``inflight-env-<name>`` at ``/env/<name>``, beside
the pool's ``/``), played through :class:`~rollout.episodes.env_http.HttpEnvironment` at the URL the deploy returns, with
episodes spread over two replicas (the state travels with each call); then removed. A class that cannot be built
fails the deploy with its reason and leaves no application."""
from __future__ import annotations

import asyncio

import httpx
import pytest

ENV_FILE = '''
import re
from rollout.episodes.environment import EnvStep, Message

class GuessNumber:
    def __init__(self, guesses):
        self.guesses = guesses

    def reset(self, task):
        return {"secret": int(task["secret"]), "left": self.guesses}, [Message("user", "Guess my number.")]

    def step(self, state, turn):
        guess, state["left"] = int(re.findall(r"\\d+", turn.text)[-1]), state["left"] - 1
        if guess == state["secret"] or state["left"] == 0:
            return EnvStep.final(1.0 if guess == state["secret"] else 0.0)
        return EnvStep.more([Message("user", "higher" if guess < state["secret"] else "lower")])
'''


async def bisect(env, secret: int) -> float | None:
    """Plays one episode by bisection; the reward."""
    state, first = await env.reset({"secret": secret})
    assert first[0].content == "Guess my number."
    lo, hi = 1, 100
    for _ in range(10):
        guess = (lo + hi) // 2
        step = await env.step(state, _turn(str(guess)))
        if step.done:
            assert step.failure is None, step.failure
            return step.reward
        lo, hi = (guess + 1, hi) if step.observation[0].content == "higher" else (lo, guess - 1)
    return None


def _turn(text: str):
    from rollout.episodes.environment import Turn

    return Turn(text)


def test_an_environment_server_deploys_serves_through_its_url_and_goes(ray_cluster, tmp_path):
    from ray import serve

    from rollout.episodes.env_http import EnvironmentCallError, HttpEnvironment
    from services.pool.env_server import app_name, deploy_environment, shutdown_environment

    path = tmp_path / "guess_env.py"
    path.write_text(ENV_FILE)
    url = deploy_environment("guess-test", f"{path}:GuessNumber", {"guesses": 7}, num_replicas=2, http_port=0)
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/env/guess-test")
        assert serve.status().applications[app_name("guess-test")].status == "RUNNING"

        async def play():
            async with HttpEnvironment(url, "guess-test", timeout_s=30, max_concurrent_calls=4,
                                       max_retries=1, retry_backoff_s=0.05) as env:
                rewards = await asyncio.gather(*(bisect(env, s) for s in (1, 37, 64, 100, 50, 2)))
                with pytest.raises(EnvironmentCallError) as err:
                    await env.reset({"level": 1})
                return env, rewards, err.value

        env, rewards, err = asyncio.run(play())
        assert rewards == [1.0] * 6
        assert env.stats.ok == env.stats.calls - 1 and env.stats.max_in_flight <= 4
        assert err.kind == "http_5xx"
        assert err.reason == ("environment 'guess-test': POST /reset: HTTP 500 after 2 attempts: environment "
                              "'guess-test': reset raised KeyError: 'secret'")
    finally:
        shutdown_environment("guess-test")
    assert app_name("guess-test") not in serve.status().applications
    assert httpx.get(f"{url}/healthz", trust_env=False).status_code == 404


def test_an_environment_that_cannot_be_built_fails_the_deploy_and_leaves_nothing(ray_cluster, tmp_path):
    from ray import serve

    from services.pool.env_server import EnvironmentDeployError, app_name, deploy_environment

    path = tmp_path / "guess_env.py"
    path.write_text(ENV_FILE)
    with pytest.raises(EnvironmentDeployError, match=r"environment server 'bad-kwargs' .* did not start: .*"
                                                     r"GuessNumber\(\*\*kwargs\) failed: TypeError") as err:
        deploy_environment("bad-kwargs", f"{path}:GuessNumber", {"gueses": 1}, http_port=0, ready_timeout_s=60)
    assert "its Serve application was removed" in str(err.value)
    assert app_name("bad-kwargs") not in serve.status().applications
    with pytest.raises(ValueError, match="cannot import"):
        deploy_environment("no-module", "no_such_module_xyz:Env", http_port=0)


def test_an_environment_server_lives_beside_the_pool_on_one_proxy(data_pool, tmp_path):
    """The pool has route prefix "/"; ``/env/<name>`` is longer, so the proxy sends each its own requests."""
    from rollout.episodes.env_http import HttpEnvironment
    from services.pool.env_server import deploy_environment, shutdown_environment

    path = tmp_path / "guess_env.py"
    path.write_text(ENV_FILE)
    url = deploy_environment("beside-pool", f"{path}:GuessNumber", {"guesses": 7})
    try:
        proxy = url.removesuffix("/env/beside-pool")
        assert httpx.get(f"{proxy}/healthz", trust_env=False).json() == {"status": "ok",
                                                                         "pool": data_pool.rollout_pool.name}

        async def play():
            async with HttpEnvironment(url, "beside-pool", timeout_s=30) as env:
                return await bisect(env, 77)

        assert asyncio.run(play()) == 1.0
    finally:
        shutdown_environment("beside-pool")
    assert httpx.get(f"{proxy}/healthz", trust_env=False).status_code == 200  # the pool is untouched
