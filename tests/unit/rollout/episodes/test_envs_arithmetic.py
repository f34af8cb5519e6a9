"""Multi-step arithmetic with the calculator, played by scripted turns: calls answered with results, malformed
calls with an error the model reads, the final answer scored by math_exact; the problems' answers check out."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from rollout.episodes.calculator import evaluate
from rollout.episodes.env_registry import EnvironmentSpec, build_environment
from rollout.episodes.environment import Turn
from rollout.episodes.envs.arithmetic import FORMS, CalculatorArithmetic, make_problem, problem_text
from rollout.rewards.reward_fns import math_exact

TASK = {"answer": 21, "expression": "(2 + 5) * 3"}


def call(expression: str) -> str:
    return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": expression}})}\n</tool_call>'


def play(env, task: dict, texts: list[str]):
    async def main():
        state, opening = await env.reset(task)
        assert opening == []
        steps = []
        for text in texts:
            steps.append(await env.step(state, Turn(text, (1, 2))))
            if steps[-1].done:
                break
        return steps
    return asyncio.run(main())


def envs():
    """The class, and what a recipe's tool_calls section with math_exact builds (the registry)."""
    spec = EnvironmentSpec("calc", "tool_calls", tools=("calculator",), max_tool_calls=4)
    return [CalculatorArithmetic(), build_environment(spec, math_exact, 10.0)]


@pytest.mark.parametrize("env", envs(), ids=["class", "registry"])
def test_a_correct_call_then_the_correct_answer_scores_one(env):
    steps = play(env, TASK, ["Let me compute. " + call("(2 + 5) * 3"), "The answer is \\boxed{21}."])
    assert [s.done for s in steps] == [False, True]
    [result] = steps[0].observation
    assert (result.role, result.content, result.name) == ("tool", "21", "calculator")
    assert steps[0].info == {"tool_calls": 1, "tool_errors": 0}
    assert steps[1].reward == 1.0 and steps[1].info == {"tool_calls": 1}


@pytest.mark.parametrize("env", envs(), ids=["class", "registry"])
def test_a_malformed_call_is_answered_with_an_error_the_model_can_correct(env):
    bad_json = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 5"</tool_call>'
    steps = play(env, TASK, [bad_json, call("2 + 5") + call("7 * x"), call("7 * 3"), "21"])
    assert steps[0].observation[0].content.startswith("error: tool call 1 is not valid JSON")
    assert steps[0].info == {"tool_calls": 1, "tool_errors": 1}
    assert [m.content for m in steps[1].observation] == [
        "7", "error: calculator: names are not allowed (only numbers, + - * / ** and parentheses)"]
    assert steps[1].info == {"tool_calls": 3, "tool_errors": 1}
    assert steps[2].observation[0].content == "21"
    assert steps[3].reward == 1.0 and steps[3].info == {"tool_calls": 4}


def test_an_answer_without_calls_is_scored_and_a_wrong_one_scores_zero():
    env = CalculatorArithmetic()
    assert play(env, TASK, ["(2 + 5) * 3 = 21"])[0].reward == 1.0
    assert play(env, TASK, ["I think it is 20."])[0].reward == 0.0
    assert play(env, {"answer": -19}, ["The answer is -19."])[0].reward == 1.0


def test_calls_past_max_tool_calls_end_the_episode_scored_as_the_final_answer():
    env = CalculatorArithmetic(max_tool_calls=1)
    steps = play(env, TASK, [call("2 + 5"), call("7 * 3") + " 21"])
    assert steps[-1].done and steps[-1].reward == 1.0 and steps[-1].info["stop"] == "max_tool_calls"
    with pytest.raises(ValueError, match="max_tool_calls: expected an int >= 0"):
        CalculatorArithmetic(max_tool_calls=-1)


def test_a_task_without_an_answer_fails_the_sample():
    step = play(CalculatorArithmetic(), {}, ["21"])[0]
    assert step.failure == "reward: math_exact: task has no 'answer'"


def test_the_tool_is_the_calculator_and_problems_are_integer_with_2_or_3_operations():
    assert [s["function"]["name"] for s in CalculatorArithmetic().tool_schemas()] == ["calculator"]
    rng = random.Random(0)
    seen = set()
    for _ in range(200):
        expression, answer = make_problem(rng)
        seen.add(expression.replace("(", "").replace(")", "").count(" ") // 2)
        assert isinstance(answer, int) and evaluate(expression) == answer
        assert problem_text(expression) == f"Compute {expression}. You may call the calculator tool."
    assert seen == {2, 3} and len(FORMS) >= 4
