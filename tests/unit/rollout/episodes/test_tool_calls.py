"""Tool calls: parsing Qwen/Hermes ``<tool_call>`` blocks (malformed ones become error text, never exceptions),
the ast calculator (values, precedence, refusals, bounds), and the tool environment (calls answered with ``tool``
messages, the final answer scored, the call budget, failures that fail the sample)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from rollout.episodes import calculator
from rollout.episodes.calculator import CALCULATOR, MAX_EXPRESSION_CHARS, calculate
from rollout.episodes.environment import EnvStep, Message, Turn, as_async
from rollout.rewards.registry import math_exact
from rollout.episodes.tool_calls import (
    BadToolCall,
    Tool,
    ToolCall,
    ToolEnvironment,
    ToolError,
    ToolState,
    parse_tool_calls,
    run_tool_call,
)


def run(coro):
    return asyncio.run(coro)


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


CALC = json.dumps({"name": "calculator", "arguments": {"expression": "(2 + 5) * 3"}})
SEARCH = '{"name": "search", "arguments": {"q": "x"}}'


# --- parsing -------------------------------------------------------------------------------------------------

def test_parse_several_calls_with_text_around_them():
    text = f"Let me compute.\n{block(CALC)}\nand\n{block(SEARCH)} ok"
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "(2 + 5) * 3"}),
                                      ToolCall("search", {"q": "x"})]


def test_parse_no_calls_and_a_stray_closing_tag():
    assert parse_tool_calls("The answer is 21.") == []
    assert parse_tool_calls("done </tool_call> really") == []


@pytest.mark.parametrize("arguments,want", [
    ('{"expression": "1+1"}', {"expression": "1+1"}),          # a dict
    ('"{\\"expression\\": \\"1+1\\"}"', {"expression": "1+1"}),  # a JSON string holding one
    ('""', {}),
])
def test_parse_arguments_as_object_or_json_string(arguments, want):
    assert parse_tool_calls(block(f'{{"name": "calculator", "arguments": {arguments}}}')) == [
        ToolCall("calculator", want)]
    assert parse_tool_calls(block('{"name": "now"}')) == [ToolCall("now", {})]


@pytest.mark.parametrize("body,error", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"}', "tool call 1 is not valid JSON: Expecting ',' "
                                                                  "delimiter (line 1 column 58)"),
    ("{'name': 'calculator'}", "tool call 1 is not valid JSON: Expecting property name enclosed in double quotes"),
    ('{"arguments": {}}', 'tool call 1 has no "name" (a non-empty string)'),
    ('{"name": "  ", "arguments": {}}', 'tool call 1 has no "name" (a non-empty string)'),
    ('{"name": 3}', 'tool call 1 has no "name" (a non-empty string)'),
    ('["calculator"]', 'tool call 1 must be a JSON object {"name": ..., "arguments": {...}}, got an array'),
    ('{"name": "calculator", "arguments": [1]}', "tool call 1 (calculator): arguments must be a JSON object, got "
                                                 "an array"),
    ('{"name": "calculator", "arguments": "{oops"}', "tool call 1 (calculator): arguments are not valid JSON"),
])
def test_parse_malformed_calls_say_what_is_wrong(body, error):
    [got] = parse_tool_calls(block(body))
    assert isinstance(got, BadToolCall) and got.error.startswith(error), got


def test_parse_survives_json_that_python_refuses():
    huge, deep = block('{"name": "calculator", "arguments": {"x": ' + "9" * 5000 + "}}"), block("[" * 100_000)
    for text, error in ((huge, "ValueError: Exceeds the limit"), (deep, "RecursionError")):
        [got] = parse_tool_calls(text)
        assert isinstance(got, BadToolCall) and got.error.startswith(f"tool call 1 is not valid JSON: {error}"), got
    [got] = parse_tool_calls(block(json.dumps({"name": "c", "arguments": '{"x": ' + "9" * 5000 + "}"})))
    assert isinstance(got, BadToolCall) and "arguments are not valid JSON: ValueError" in got.error


def test_parse_keeps_order_of_good_and_bad_calls_and_an_unclosed_last_one():
    text = block(CALC) + block("{bad") + "<tool_call>\n{\"name\": \"calculator\", \"argu"
    got = parse_tool_calls(text)
    assert isinstance(got[0], ToolCall) and isinstance(got[1], BadToolCall) and got[1].error.startswith("tool call 2")
    assert got[2] == BadToolCall("tool call 3 has no closing </tool_call>")


# --- running one call ----------------------------------------------------------------------------------------

def echo(text: str, times: int = 1) -> str:
    return text * times


async def lookup(key: str) -> dict:
    await asyncio.sleep(0)
    if key == "missing":
        raise ToolError(f"no entry {key!r}")
    return {"key": key, "value": 1}


def crash(x: str) -> str:
    raise RuntimeError("tool backend is down")


ECHO = Tool("echo", "Repeat text.", {"type": "object", "properties": {"text": {"type": "string"},
                                                                        "times": {"type": "integer"}},
                                      "required": ["text"]}, echo)
LOOKUP = Tool("lookup", "Look up a key.", {"type": "object", "properties": {"key": {"type": "string"}},
                                           "required": ["key"]}, lookup)
CRASH = Tool("crash", "Always fails.", {"type": "object", "properties": {"x": {"type": "string"}}}, crash)
TOOLS = {t.name: t for t in (ECHO, LOOKUP, CALCULATOR, CRASH)}


@pytest.mark.parametrize("call,content", [
    (ToolCall("echo", {"text": "ab", "times": 2}), "abab"),
    (ToolCall("lookup", {"key": "k"}), '{"key": "k", "value": 1}'),              # async tool, JSON result
    (ToolCall("calculator", {"expression": "(2 + 5) * 3"}), "21"),
    (ToolCall("lookup", {"key": "missing"}), "error: lookup: no entry 'missing'"),  # ToolError: the model reads it
    (ToolCall("search", {"q": "x"}), "error: unknown tool 'search'; the tools are ['calculator', 'crash', 'echo', "
                                     "'lookup']"),
    (ToolCall("echo", {}), "error: echo: missing argument(s) ['text']"),
    (ToolCall("echo", {"text": "a", "loud": True}), "error: echo: unknown argument(s) ['loud']; echo takes "
                                                    "['text', 'times']"),
    (ToolCall("echo", {"text": 3}), "error: echo: argument 'text' must be a string, got an integer"),
    (ToolCall("echo", {"text": "a", "times": True}), "error: echo: argument 'times' must be an integer, got a "
                                                     "boolean"),
    (ToolCall("calculator", {"expression": "1/0"}), "error: calculator: division by zero"),
    (BadToolCall("tool call 1 is not valid JSON: x"), "error: tool call 1 is not valid JSON: x"),
])
def test_run_tool_call_answers_with_a_tool_message(call, content):
    got = run(run_tool_call(TOOLS, call))
    assert got.role == "tool" and got.content == content
    assert got.name == call.name


def test_a_tool_that_crashes_raises_so_the_environment_fails():
    with pytest.raises(RuntimeError, match="backend is down"):
        run(run_tool_call(TOOLS, ToolCall("crash", {"x": "1"})))


def test_tool_schema_is_what_chat_templates_list():
    assert CALCULATOR.schema() == {"type": "function", "function": {
        "name": "calculator", "description": CALCULATOR.description, "parameters": CALCULATOR.parameters}}
    with pytest.raises(ValueError, match="needs a name"):
        Tool("", "x", {"properties": {}}, echo)


# --- the calculator ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression,value", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("2 ** 3 ** 2", "512"), ("-2 ** 2", "-4"), ("(-2) ** 2", "4"),
    ("7 / 2", "3.5"), ("6 / 3", "2"), ("0.1 + 0.2", "0.3"), ("2 ** -1", "0.5"), ("--3", "3"), ("+-2.5 * 2", "-5"),
    ("10 - 4 - 3", "3"), ("100 / 10 / 5", "2"), ("1.5e3 + 1", "1501"), ("0 ** 0", "1"), (" 12 ", "12"),
    ("10 ** 100", str(10 ** 100)), ("-" * 499 + "1", "-1"), ("2 ** 0.5", "1.4142135623731"), ("1e20", "1e+20"),
    ("(((((4)))))", "4"),
])
def test_calculator_values_and_precedence(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression,error", [
    ("1 / 0", "division by zero"), ("0 ** -1", "division by zero"), ("5 / (2 - 2)", "division by zero"),
    ("2 ** 10000", "exponent 10000 too large"), ("9 ** 9 ** 9", "exponent 387420489 too large"),
    ("2 ** 1000", "result too large"), ("10 ** 101", "result too large"), ("1e100 * 10", "result too large"),
    ("1e999", "number too large"), ("9" * 101, "number too large"), ("(-8) ** (1 / 3)", "not a real number"),
    ("x + 1", "names are not allowed"), ("__import__('os').system('ls')", "function calls are not allowed"),
    ("(1).real", "attributes are not allowed"), ("abs(-1)", "function calls are not allowed"),
    ("[1][0]", "subscripts are not allowed"), ("1 if 1 else 2", "IfExp is not allowed"),
    ("7 // 2", "operator FloorDiv"),
    ("7 % 2", "operator Mod"), ("1 << 100", "operator LShift"), ("True + 1", "only numbers are allowed"),
    ("'a' * 3", "only numbers are allowed"), ("1j", "only numbers are allowed"), ("1 < 2", "comparisons"),
    ("", "empty expression"), ("1 +", "not an arithmetic expression"), ("1; 2", "not an arithmetic expression"),
    ("1 " * MAX_EXPRESSION_CHARS, "expression too long"), ("~1", "UnaryOp is not allowed"),
    ("lambda: 1", "lambdas are not allowed"), ("(" * 249 + "1" + ")" * 249, "too many nested parentheses"),
])
def test_calculator_refuses_with_the_reason(expression, error):
    with pytest.raises(ToolError) as info:
        calculate(expression)
    assert error in str(info.value)


def test_a_huge_power_is_refused_before_it_is_computed(monkeypatch):
    monkeypatch.setattr(calculator, "MAX_EXPONENT", 10 ** 8)  # only the magnitude bound left to stop it
    t0 = time.monotonic()
    with pytest.raises(ToolError, match="result too large"):
        calculate("7 ** 30000000")  # 84 million bits if it were computed
    assert time.monotonic() - t0 < 1


def test_calculator_tool_takes_a_string_expression():
    assert run(run_tool_call(TOOLS, ToolCall("calculator", {"expression": 3}))).content == (
        "error: calculator: argument 'expression' must be a string, got an integer")


# --- the tool environment ------------------------------------------------------------------------------------

def env_of(max_tool_calls: int = 4) -> ToolEnvironment:
    return ToolEnvironment([CALCULATOR, CRASH], math_exact, max_tool_calls=max_tool_calls)


def test_tool_turn_gets_results_then_the_final_answer_is_scored():
    env = env_of()

    async def go():
        state, first = await env.reset({"answer": 21})
        a = await env.step(state, Turn(f"First I compute.\n{block(CALC)}\n{block('{nope')}"))
        b = await env.step(state, Turn("So the answer is \\boxed{21}."))
        return state, first, a, b

    state, first, a, b = run(go())
    assert first == [] and not a.done and a.reward is None
    assert a.observation[0] == Message("tool", "21", name="calculator")
    assert a.observation[1].role == "tool" and a.observation[1].content.startswith("error: tool call 2 is not "
                                                                                    "valid JSON")
    assert a.info == {"tool_calls": 2, "tool_errors": 1}
    assert (b.done, b.reward, b.failure, b.info) == (True, 1.0, None, {"tool_calls": 2})
    assert state == ToolState({"answer": 21}, 2)


def test_a_wrong_final_answer_scores_zero_and_a_bad_task_fails():
    assert run(env_of().step(ToolState({"answer": 21}), Turn("\\boxed{20}"))).reward == 0.0
    got = run(env_of().step(ToolState({}), Turn("\\boxed{20}")))
    assert (got.reward, got.failure) == (None, "reward: math_exact: task has no 'answer'")


def test_the_call_budget_ends_the_episode_with_the_turn_scored():
    env = env_of(max_tool_calls=2)
    state = ToolState({"answer": 21})
    first = run(env.step(state, Turn(block(CALC) + block(CALC))))
    assert not first.done and state.tool_calls == 2
    last = run(env.step(state, Turn(block(CALC) + " \\boxed{21}")))
    assert (last.done, last.reward, last.info) == (True, 1.0, {"tool_calls": 2, "stop": "max_tool_calls"})
    assert state.tool_calls == 2


def test_the_last_turn_the_engine_allows_is_scored_even_with_calls():
    state = ToolState({"answer": 21})
    last = run(env_of().step(state, Turn(block(CALC) + " \\boxed{21}", final=True)))
    assert (last.done, last.reward, last.info) == (True, 1.0, {"tool_calls": 0, "stop": "last_turn"})
    assert state.tool_calls == 0  # the calls of a final turn are not run


def test_a_crashing_tool_fails_the_sample_through_as_async_never_zero():
    got = run(as_async(env_of(), 5).step(ToolState({"answer": 1}), Turn(block('{"name": "crash", '
                                                                              '"arguments": {"x": "y"}}'))))
    assert isinstance(got, EnvStep) and got.reward is None
    assert got.failure == "environment 'tools': step raised RuntimeError: tool backend is down"


def test_tool_environment_checks_its_arguments_and_lists_schemas():
    assert [s["function"]["name"] for s in env_of().tool_schemas()] == ["calculator", "crash"]
    with pytest.raises(ValueError, match="at most once"):
        ToolEnvironment([CALCULATOR, CALCULATOR], math_exact)
    with pytest.raises(ValueError, match="max_tool_calls"):
        ToolEnvironment([CALCULATOR], math_exact, max_tool_calls=-1)
