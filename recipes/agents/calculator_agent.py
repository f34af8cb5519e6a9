"""Multi-step arithmetic as a plain OpenAI-client agent with a tool: no Inflight import (docs/agents.md).

The agent shows the model a ``calculator`` function (OpenAI's ``tools``), runs each call it makes and answers with
the result (a ``tool`` message), until the model answers without a call or ``MAX_TOOL_CALLS`` calls were made.
The reward is 1.0 when the final answer's last number equals ``task["answer"]``, else 0.0. ``task["expression"]``
is the problem (the ``multi_step_arithmetic`` dataset makes both).
"""
from __future__ import annotations

import ast
import json
import operator
import re

MAX_TOOL_CALLS = 4
MAX_TOKENS = 48
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of integers with + - * / and ( ).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of ``expression`` (integers, + - * / and parentheses), or why it has none."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and abs(node.value) < 10**9:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only integers, + - * / and parentheses")
    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def last_number(text: str) -> float | None:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


async def run(task: dict, client) -> float:
    model = (await client.models.list()).data[0].id
    messages = [{"role": "user", "content": f"Compute {task['expression']}. You may call the calculator tool."}]
    for _ in range(MAX_TOOL_CALLS + 1):
        answer = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR],
                                                      tool_choice="auto", max_tokens=MAX_TOKENS, temperature=1.0)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = str(json.loads(call.function.arguments).get("expression", ""))
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    final = last_number(messages[-1].get("content") or "") if messages[-1]["role"] == "assistant" else None
    return 1.0 if final is not None and final == float(task["answer"]) else 0.0
