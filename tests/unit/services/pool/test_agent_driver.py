"""The agent driver (services/pool/agent_driver.py) with a coroutine agent and captured calls made by hand: each
sample is a session of its own whose calls become its trajectory on the group's shared prompt; an agent that
raises, overruns its deadline, gives no finite reward or breaks its session fails its sample with the reason;
episodes run at most ``max_concurrent`` at once; and every outcome is counted."""
from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from protocol import PromptRequest
from services.pool.agent_driver import AgentDriver, AgentSpec
from services.pool.agent_server import load_agent
from services.pool.token_capture import CapturedChoice, CapturedCompletion, VersionSpan

PROMPT = [1, 2, 3, 4, 5]
CAPTURED: dict[str, list[CapturedCompletion]] = {}
"""What the fake engine served, by session (the agents below put it there, as the engine's capture would)."""
RUNNING = {"now": 0, "most": 0}


def session_of(client) -> str:
    """The session a rollout key names (``ifr1.<session>.<mac>``)."""
    return client.api_key[len("ifr1."):].rpartition(".")[0]


def served(session: str, prompt: list[int], ids: list[int], version: int = 0) -> None:
    choice = CapturedChoice(list(ids), [-0.25] * len(ids), [VersionSpan(version, 0, len(ids))], "stop")
    CAPTURED.setdefault(session, []).append(CapturedCompletion(f"r{len(CAPTURED)}", list(prompt), {0: choice}))


async def two_turns(task: dict, client) -> float:
    """Two calls: an answer, the user's reply (env tokens 40, 41), a second answer sampled after a push."""
    s = session_of(client)
    served(s, PROMPT, [10, 11, 12], 0)
    served(s, [*PROMPT, 10, 11, 12, 40, 41], [13, 14], 1)
    return float(task["reward"])


async def edits_its_history(task: dict, client) -> float:
    s = session_of(client)
    served(s, PROMPT, [10, 11], 0)
    served(s, [*PROMPT, 10, 99, 40], [13], 0)  # answer 1 comes back as other tokens
    return 1.0


async def raises(task: dict, client) -> float:
    raise RuntimeError("tool sandbox crashed")


async def sleeps(task: dict, client) -> float:
    await asyncio.sleep(5)
    return 1.0


async def gives(task: dict, client):
    served(session_of(client), PROMPT, [10], 0)
    return task["reward"]


async def counts_concurrency(task: dict, client) -> float:
    RUNNING["now"] += 1
    RUNNING["most"] = max(RUNNING["most"], RUNNING["now"])
    await asyncio.sleep(0.02)
    RUNNING["now"] -= 1
    served(session_of(client), PROMPT, [10], 0)
    return 0.5


def driver(agent: str, timeout_s: float = 10.0, max_concurrent: int = 8) -> AgentDriver:
    """A driver of this file's ``agent`` (loaded by path: a module of its own, whose ``CAPTURED`` the fake
    engine's ``take_session`` reads)."""
    spec = AgentSpec("calc", f"{__file__}:{agent}", "http://127.0.0.1:1", "secret", "tiny", timeout_s,
                     max_concurrent, 0, 0.0)
    d = AgentDriver(spec, "pool-engine-0", lambda s: agent_globals(d)["CAPTURED"].pop(s, []), lambda: 100)
    return d


def agent_globals(d: AgentDriver) -> dict:
    assert d._run is not None
    return d._run.__globals__


def play(d: AgentDriver, task: dict, group_size: int = 2, prompt_id: str = "p-1"):
    async def go():
        try:
            return await d.group(PromptRequest(prompt_id, np.asarray(PROMPT[:2]), task, scheduled_step=3), group_size)
        finally:
            await d.aclose()

    return asyncio.run(go())


def test_each_sample_is_a_session_laid_out_token_in_token_out():
    d = driver("two_turns")
    group = play(d, {"reward": 0.75})
    assert group.prompt_ids.tolist() == PROMPT and group.group_size == 2 and group.scheduled_step == 3
    assert group.engine_id == "pool-engine-0" and group.vocab_size == 100
    for t in group.trajectories:
        assert t.ok and t.reward == 0.75
        assert t.response_ids.tolist() == [10, 11, 12, 40, 41, 13, 14]
        assert t.loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 1]
        assert t.sampled_versions.tolist() == [0, 0, 0, 1, 1]
    assert not agent_globals(d)["CAPTURED"], "every session was taken from the engine"
    assert d.snapshot() == {"name": "calc", "episodes": 2, "env_failures": 0, "env_wait_seconds": pytest.approx(
        d.stats.env_wait_seconds), "calls": {"ok": 2}, "retries": 0}


@pytest.mark.parametrize("agent, outcome, words", [
    ("raises", "agent_error", "agent 'calc' raised RuntimeError: tool sandbox crashed"),
    ("sleeps", "timeout", "the episode took over 0.2s (env.calc.agent_timeout_s)"),
    ("edits_its_history", "session_broken", "session refused: call 1's prompt does not extend the episode"),
])
def test_a_failed_episode_fails_its_sample_with_the_reason(agent, outcome, words):
    d = driver(agent, timeout_s=0.2)
    group = play(d, {})
    for t in group.trajectories:
        assert not t.ok and t.reward is None and t.finish_reason == "error" and t.failure_kind == "environment"
        assert words in t.error, t.error
    assert d.stats.calls == {outcome: 2} and d.stats.env_failures == 2 and not agent_globals(d)["CAPTURED"]


@pytest.mark.parametrize("reward", [math.nan, math.inf, True, "1.0", None])
def test_a_reward_that_is_not_a_finite_number_fails_the_sample(reward):
    d = driver("gives")
    (t,) = play(d, {"reward": reward}, group_size=1).trajectories
    assert not t.ok and f"gave reward {reward!r}; expected a finite number" in t.error
    assert d.stats.calls == {"bad_reward": 1}


def test_episodes_run_at_most_max_concurrent_at_once():
    d = driver("counts_concurrency", max_concurrent=3)
    group = play(d, {}, group_size=8)
    assert all(t.ok for t in group.trajectories) and agent_globals(d)["RUNNING"]["most"] == 3


def test_load_agent_refuses_what_is_not_run_task_client(tmp_path):
    f = tmp_path / "agents.py"
    f.write_text("def plain(task, client):\n    return 1.0\n\nasync def one(task):\n    return 1.0\n\n"
                 "async def run(task, client):\n    return 1.0\n")
    assert load_agent(f"{f}:run", "calc").__name__ == "run"
    for name, words in (("plain", "expected a coroutine function"), ("one", "cannot be called as run(task, client)"),
                        ("missing", "the module has no 'missing'")):
        with pytest.raises(ValueError, match=r"env\.calc\.agent") as err:
            load_agent(f"{f}:{name}", "calc")
        assert words in str(err.value)


async def strangers(task: dict, client) -> float:
    """Each episode begins with a prompt of its own: the group's episodes share no token."""
    RUNNING["most"] += 1
    served(session_of(client), [100 + RUNNING["most"], *PROMPT], [10], 0)
    return 1.0


def test_episodes_that_share_no_token_are_refused_against_the_data_prompt():
    d = driver("strangers")
    group = play(d, {}, group_size=2)
    assert group.prompt_ids.tolist() == PROMPT[:2]  # the data's prompt: no shared prefix to lay the group on
    for t in group.trajectories:
        assert not t.ok and "call 0's prompt does not begin with the group's prompt" in t.error
