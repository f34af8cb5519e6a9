"""The environment interface: messages and steps that refuse a mix, plain and async environments behind a
deadline (an exception, a timeout or a malformed answer is a failed step naming the environment, never reward 0),
the example of docs/environments.md as written there, and the single-turn environment giving exactly today's
rewards, components and failures."""
from __future__ import annotations

import asyncio
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rollout.episodes.environment import EnvStep, Message, SingleTurnEnvironment, Turn, as_async
from rollout.rewards.reward_env import RewardEnv, WeightedReward, score_samples
from rollout.rewards.registry import RewardFailure, RewardInput, RewardResult, format_reward, math_exact, repeat_letter


def run(coro):
    return asyncio.run(coro)


DOCS = Path(__file__).resolve().parents[4] / "docs" / "environments.md"


def docs_example() -> type:
    """The 15-line environment of docs/environments.md, run as written there."""
    [code] = [b for b in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.DOTALL) if "class GuessNumber" in b]
    namespace: dict[str, Any] = {}
    exec(compile(code, str(DOCS), "exec"), namespace)
    return namespace["GuessNumber"]


GuessNumber = docs_example()


async def episode(env, task: dict, turns: list[str]) -> tuple[list[Message], list[EnvStep]]:
    started = await env.reset(task)
    assert not isinstance(started, EnvStep), started
    state, first = started
    steps = []
    for text in turns:
        steps.append(await env.step(state, Turn(text)))
        if steps[-1].done:
            break
    return first, steps


# --- messages and steps -------------------------------------------------------------------------------------

def test_message_to_chat_carries_tool_fields_only_when_set():
    assert Message("user", "hi").to_chat() == {"role": "user", "content": "hi"}
    assert Message("tool", "7", name="calculator", tool_call_id="c1").to_chat() == {
        "role": "tool", "content": "7", "name": "calculator", "tool_call_id": "c1"}
    with pytest.raises(ValueError, match="Message.role"):
        Message("robot", "hi")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="content"):
        Message("user", 3)  # pyright: ignore[reportArgumentType]


def test_env_step_constructors_and_invariants():
    assert EnvStep.final(1, {"a": 0.5}, {"turns": 2}) == EnvStep([], 1.0, True, {"turns": 2}, {"a": 0.5})
    assert isinstance(EnvStep.final(1).reward, float)
    more = EnvStep.more([Message("user", "higher")], {"left": 2})
    assert (more.done, more.reward, more.failure) == (False, None, None)
    failed = EnvStep.failed("server down")
    assert (failed.done, failed.reward, failed.observation) == (True, None, [])
    for bad in (lambda: EnvStep.more([]), lambda: EnvStep(reward=1.0), lambda: EnvStep.final(True),
                lambda: EnvStep.final(float("nan")), lambda: EnvStep(reward=1.0, done=True, failure="x"),
                lambda: EnvStep([Message("user", "x")], 1.0, True), lambda: EnvStep.failed(""),
                lambda: EnvStep(observation=[Message("user", "x")], components={"a": 1.0})):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(TypeError, match="list of Message"):
        EnvStep.more([{"role": "user", "content": "x"}])  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="info: 'bad'"):
        EnvStep.final(1.0, info={"bad": [1]})  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="components: 'f'"):
        EnvStep.final(1.0, components={"f": "high"})  # pyright: ignore[reportArgumentType]


# --- plain and async environments ----------------------------------------------------------------------------

def test_plain_environment_plays_an_episode_through_as_async():
    env = as_async(GuessNumber(), timeout_s=5)
    first, steps = run(episode(env, {"secret": 42}, ["50", "no idea", "I say 30", "42", "never reached"]))
    assert first == [Message("user", "Guess my number between 1 and 100.")]
    assert [s.observation[0].content for s in steps[:3]] == ["lower; 2 guesses left", "Answer with a number.",
                                                             "higher; 1 guesses left"]
    assert (len(steps), steps[-1].done, steps[-1].reward) == (4, True, 1.0)


def test_plain_environment_with_a_bad_task_fails_the_sample():
    got = run(as_async(GuessNumber(), 5).reset({"answer": 42}))
    assert isinstance(got, EnvStep) and got.failure == "environment 'GuessNumber': reset raised KeyError: 'secret'"


def test_plain_environment_out_of_guesses_scores_zero_as_a_measurement():
    _, steps = run(episode(as_async(GuessNumber(), 5), {"secret": 42}, ["1", "2", "3"]))
    assert (steps[-1].done, steps[-1].reward, steps[-1].failure) == (True, 0.0, None)


class AsyncCounter:
    name = "counter"

    async def reset(self, task: dict) -> tuple[list[int], list[Message]]:
        await asyncio.sleep(0)
        return [0], []

    async def step(self, state: list[int], turn: Turn) -> EnvStep:
        await asyncio.sleep(0)
        state[0] += len(turn.token_ids)
        return EnvStep.final(state[0]) if state[0] >= 3 else EnvStep.more([Message("user", str(state[0]))])


def test_async_environment_runs_on_the_loop_and_keeps_its_state():
    env = as_async(AsyncCounter(), 5)
    assert env.name == "counter"

    async def go():
        state, first = await env.reset({})  # pyright: ignore[reportGeneralTypeIssues]
        a = await env.step(state, Turn("x", (1, 2)))
        b = await env.step(state, Turn("y", (3,)))
        return first, a, b

    first, a, b = run(go())
    assert first == [] and a.observation == [Message("user", "2")] and (b.done, b.reward) == (True, 3.0)


class WhereItRuns:
    """Records the thread each method ran on; ``step`` is a plain method that returns a coroutine."""

    def __init__(self):
        self.threads: list[str] = []

    async def reset(self, task: dict) -> tuple[dict, list[Message]]:
        self.threads.append(threading.current_thread().name)
        return {}, []

    def step(self, state: dict, turn: Turn) -> Any:
        self.threads.append(threading.current_thread().name)
        return self._score(turn)

    async def _score(self, turn: Turn) -> EnvStep:
        return EnvStep.final(len(turn.text))


def test_async_methods_run_on_the_loop_plain_ones_on_a_thread_and_a_returned_coroutine_is_awaited():
    env = WhereItRuns()

    async def go():
        bounded = as_async(env, 5)
        started = await bounded.reset({})
        assert not isinstance(started, EnvStep)
        return threading.current_thread().name, await bounded.step(started[0], Turn("four"))

    loop_thread, got = run(go())
    assert (got.reward, got.failure) == (4.0, None)
    assert env.threads[0] == loop_thread and env.threads[1] != loop_thread


def test_an_async_environment_needs_no_thread_of_the_pool():
    pool = ThreadPoolExecutor(1)
    release = threading.Event()
    pool.submit(release.wait, 10)  # the only thread is busy (a hung plain environment)
    try:
        got = run(as_async(AsyncCounter(), 2, executor=pool).step([5], Turn("x", (1,))))
    finally:
        release.set()
        pool.shutdown()
    assert (got.reward, got.failure) == (6.0, None)


class Broken:
    """reset/step misbehave as ``mode`` says."""

    def __init__(self, mode: str, release: threading.Event | None = None):
        self.mode, self.release = mode, release

    def reset(self, task: dict) -> Any:  # deliberately not always (state, messages)
        if self.mode == "reset_raises":
            raise KeyError("secret")
        if self.mode == "reset_shape":
            return [Message("user", "hi")]
        return {}, []

    def step(self, state: Any, turn: Turn) -> Any:  # deliberately not always an EnvStep
        if self.mode == "raises":
            raise RuntimeError("judge server said 503")
        if self.mode == "hangs":
            assert self.release is not None
            self.release.wait(10)
            return EnvStep.final(1.0)
        if self.mode == "float":
            return 0.0
        if self.mode == "own_failure":
            return EnvStep.failed("sandbox crashed")
        if self.mode == "bad_step":
            return EnvStep(reward=1.0)  # a reward before done: refused by EnvStep
        if self.mode == "named_failure":  # what a server client answers: the environment named already
            return EnvStep.failed("environment 'judge': POST /step: HTTP 500 after 3 attempts")
        if self.mode == "named_raise":
            raise RuntimeError("environment 'judge': POST /step: timed out after 2s (3 attempts)")
        raise AssertionError(self.mode)


@pytest.mark.parametrize("mode,reason", [
    ("raises", "environment 'judge': step raised RuntimeError: judge server said 503"),
    ("float", "environment 'judge': step returned float 0.0, expected an EnvStep"),
    ("own_failure", "environment 'judge': sandbox crashed"),
    ("bad_step", "environment 'judge': step raised ValueError: EnvStep.reward: only a done step has a reward"),
    ("named_failure", "environment 'judge': POST /step: HTTP 500 after 3 attempts"),
    ("named_raise", "environment 'judge': POST /step: timed out after 2s (3 attempts)"),
])
def test_a_failing_step_is_a_failed_step_with_the_environment_named(mode, reason):
    got = run(as_async(Broken(mode), 5, name="judge").step({}, Turn("answer")))
    assert (got.failure, got.reward, got.done, got.observation) == (reason, None, True, [])


@pytest.mark.parametrize("mode,reason", [
    ("reset_raises", "environment 'Broken': reset raised KeyError: 'secret'"),
    ("reset_shape", "environment 'Broken': reset returned list [Message(role='user', content='hi', name=None, "
                    "tool_call_id=None)], expected (state, list[Message])"),
])
def test_a_failing_reset_is_a_failed_step(mode, reason):
    got = run(as_async(Broken(mode), 5).reset({"x": 1}))
    assert isinstance(got, EnvStep) and got.failure == reason and got.reward is None


def test_a_hung_plain_step_fails_at_its_deadline_without_waiting_for_the_thread():
    release = threading.Event()
    env = as_async(Broken("hangs", release), timeout_s=0.2, name="slow")
    t0 = time.monotonic()
    try:
        got = run(_timed_step(env, release))
    finally:
        release.set()
    assert got.failure == "environment 'slow': step timed out after 0.2s" and got.reward is None
    assert time.monotonic() - t0 < 5


async def _timed_step(env, release: threading.Event) -> EnvStep:
    got = await env.step({}, Turn("x"))
    release.set()  # before asyncio.run waits for the default executor's threads
    return got


class HangsAsync:
    cancelled = False

    async def reset(self, task: dict) -> tuple[dict, list[Message]]:
        return {}, []

    async def step(self, state: dict, turn: Turn) -> EnvStep:
        try:
            await asyncio.sleep(100)
        except asyncio.CancelledError:
            HangsAsync.cancelled = True
            raise
        return EnvStep.final(1.0)


def test_a_hung_async_step_is_cancelled_at_its_deadline():
    t0 = time.monotonic()
    got = run(as_async(HangsAsync(), timeout_s=0.1).step({}, Turn("x")))
    assert got.failure == "environment 'HangsAsync': step timed out after 0.1s"
    assert HangsAsync.cancelled and time.monotonic() - t0 < 5


def test_as_async_refuses_a_bad_timeout_or_a_non_environment():
    with pytest.raises(ValueError, match="timeout_s"):
        as_async(GuessNumber(), 0)
    with pytest.raises(TypeError, match="no method reset"):
        as_async(object(), 1)  # pyright: ignore[reportArgumentType]


# --- the single-turn environment is today's reward -----------------------------------------------------------

def boom(batch: list[RewardInput]) -> list[RewardResult]:
    raise ZeroDivisionError("bad reward code")


async def async_half(batch: list[RewardInput]) -> list[RewardResult]:
    return [0.5 for _ in batch]


CASES = [("\\boxed{12}", (5, 6), {"answer": 12}), ("it is 13", (1,), {"answer": 12}),
         ("12", (), {}), ("The answer is 4.", (7, 7, 3), {"answer": "4", "target_token_id": 7})]


@pytest.mark.parametrize("fn", [math_exact, format_reward, repeat_letter, boom, async_half],
                         ids=lambda f: f.__name__)
def test_single_turn_environment_gives_what_the_reward_function_gives(fn):
    async def both():
        env = SingleTurnEnvironment(fn, timeout_s=5)
        out = []
        for text, ids, task in CASES:
            state, first = await env.reset(task)
            step = await env.step(state, Turn(text, ids))
            [today] = await score_samples(fn, [RewardInput(text, list(ids), dict(task))], 5)
            out.append((first, step, today))
        return out

    for first, step, today in run(both()):
        assert first == [] and step.done and step.observation == []
        if isinstance(today, RewardFailure):
            assert (step.reward, step.failure) == (None, f"reward: {today.reason}")
        else:
            assert (step.reward, step.components, step.failure) == (today.reward, today.components, None)


def test_single_turn_values_are_the_expected_ones():
    """The comparison above is against hand-known values too (so it cannot pass by both sides being wrong)."""
    async def steps():
        env = SingleTurnEnvironment(math_exact)
        return [await env.step(task, Turn(text, ids)) for text, ids, task in CASES]

    got = run(steps())
    assert [s.reward for s in got] == [1.0, 0.0, None, 1.0]
    assert got[2].failure == "reward: math_exact: task has no 'answer'"


def test_single_turn_environment_keeps_the_components_of_a_weighted_reward_env():
    reward_env = RewardEnv([WeightedReward("math_exact", 0.75), WeightedReward("format", 0.25)], 1, 20.0, "math")
    try:
        async def go():
            env = SingleTurnEnvironment(reward_env)
            state, _ = await env.reset({"answer": 12})
            return [await env.step(state, Turn(t)) for t in ("so \\boxed{12}", "12 it is", "The answer is 13")]

        got = run(go())
    finally:
        reward_env.close()
    assert [(s.reward, s.components) for s in got] == [
        (1.0, {"math_exact": 1.0, "format": 1.0}), (0.75, {"math_exact": 1.0, "format": 0.0}),
        (0.25, {"math_exact": 0.0, "format": 1.0})]


def test_single_turn_timeout_is_a_failure_not_zero():
    def slow(batch: list[RewardInput]) -> list[RewardResult]:
        time.sleep(0.5)
        return [1.0] * len(batch)

    got = run(SingleTurnEnvironment(slow, timeout_s=0.05).step({}, Turn("x")))
    assert (got.reward, got.failure) == (None, "reward: reward function timed out after 0.05s")
