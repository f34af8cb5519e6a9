"""Multi-step arithmetic with the calculator tool (docs/environments.md, "Multi-step arithmetic").

A problem is an integer expression of 2 or 3 operations ("Compute (3 + 5) * 7. You may call the calculator
tool."); its task is ``{"answer": <int>, "expression": <str>}``. :class:`CalculatorArithmetic` is
:class:`~rollout.episodes.tool_calls.ToolEnvironment` with the calculator and ``math_exact`` on the final answer, built
from plain keyword arguments -- what a recipe's ``environment: tool_calls`` with ``tools: [calculator]`` and
``reward_functions: [{name: math_exact}]`` builds too. ``services.data.tasks`` makes the prompt set
(``multi_step_arithmetic``), with the tool described by the chat template's ``tools``.
"""
from __future__ import annotations

import random

from rollout.episodes.calculator import CALCULATOR, evaluate
from rollout.episodes.tool_calls import ToolEnvironment
from rollout.rewards.reward_fns import math_exact

FORMS = ("({a} + {b}) * {c}", "{a} * {b} - {c}", "{a} + {b} * {c}", "({a} - {b}) * {c} + {d}",
         "({a} + {b}) * ({c} - {d})", "{a} * ({b} + {c}) - {d}")
"""The expressions' shapes: 2 or 3 operations on integers, so every answer is an integer."""
MAX_OPERAND = 20


def make_problem(rng: random.Random) -> tuple[str, int]:
    """A random expression (one of :data:`FORMS`, operands 2..:data:`MAX_OPERAND`) and its value."""
    form = FORMS[rng.randrange(len(FORMS))]
    expression = form.format(**{k: rng.randint(2, MAX_OPERAND) for k in "abcd"})
    value = evaluate(expression)  # the calculator's own arithmetic: the tool and the answer agree
    assert isinstance(value, int), (expression, value)
    return expression, value


def problem_text(expression: str) -> str:
    """The prompt of a problem."""
    return f"Compute {expression}. You may call the calculator tool."


class CalculatorArithmetic(ToolEnvironment):
    """The calculator tool, and ``math_exact`` scoring the final answer (the turn without a tool call: its
    ``\\boxed{}`` content, else its last number, against ``task["answer"]``)."""

    def __init__(self, max_tool_calls: int = 4, reward_timeout_s: float = 10.0, name: str = "calculator_arithmetic"):
        super().__init__([CALCULATOR], math_exact, max_tool_calls=max_tool_calls, reward_timeout_s=reward_timeout_s,
                         name=name)
