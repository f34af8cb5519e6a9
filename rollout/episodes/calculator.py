"""The ``calculator`` tool: arithmetic on integers and decimals, read with :mod:`ast` (never ``eval``).

Allowed: numbers, ``+ - * / **``, parentheses and unary minus/plus. Names, attributes, calls and every other
operator are refused, and so is anything that could take long or grow without bound: expressions over
:data:`MAX_EXPRESSION_CHARS`, exponents over :data:`MAX_EXPONENT`, any value past :data:`MAX_MAGNITUDE`.
A refusal or an arithmetic error (division by zero) is a :class:`~rollout.episodes.tool_calls.ToolError` whose text
goes back to the model.
"""
from __future__ import annotations

import ast
import math

from rollout.episodes.tool_calls import Tool, ToolError

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
"""Largest exponent (absolute value) of ``**``."""
MAX_MAGNITUDE = 1e100
"""Largest absolute value of any number in the calculation (operands, intermediate and final results)."""

_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}
_REFUSED = {ast.Name: "names", ast.Attribute: "attributes", ast.Call: "function calls",
            ast.Subscript: "subscripts", ast.Lambda: "lambdas", ast.Compare: "comparisons"}

Number = int | float


def evaluate(expression: str) -> Number:
    """The value of ``expression``; :class:`ToolError` saying what was wrong if it cannot be computed."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression too long ({len(text)} characters, at most {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, nesting too deep for the parser
        raise ToolError(f"not an arithmetic expression: {type(exc).__name__}") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, RecursionError):
        raise ToolError(f"result too large (at most {MAX_MAGNITUDE:g} in absolute value)") from None


def format_number(value: Number) -> str:
    """``7``, ``3.5``, ``0.3`` (0.1 + 0.2), ``1e+20``: 15 significant digits, integral floats without ``.0``."""
    return str(value) if isinstance(value, int) else format(value, ".15g")


def calculate(expression: str) -> str:
    """The calculator tool's function: the value of ``expression`` as text."""
    return format_number(evaluate(expression))


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression with + - * / ** and parentheses, e.g. (2 + 3) * 4 / 5.",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string", "description": "The expression to evaluate."}},
                "required": ["expression"]},
    fn=calculate,
)


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ToolError(f"only numbers are allowed, got {value!r}")
        return _bounded(value, "number")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        op = _BINARY.get(type(node.op))
        if op is None:
            raise ToolError(f"operator {type(node.op).__name__} is not allowed (only + - * / **)")
        left, right = _eval(node.left), _eval(node.right)
        if op == "**":
            return _power(left, right)
        if op == "/":
            return _bounded(left / right)
        return _bounded(left + right if op == "+" else left - right if op == "-" else left * right)
    for kind, what in _REFUSED.items():
        if isinstance(node, kind):
            raise ToolError(f"{what} are not allowed (only numbers, + - * / ** and parentheses)")
    raise ToolError(f"{type(node).__name__} is not allowed (only numbers, + - * / ** and parentheses)")


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent {format_number(exponent)} too large (at most {MAX_EXPONENT} in absolute value)")
    if base == 0:
        if exponent < 0:
            raise ZeroDivisionError
        return base ** exponent  # 0 ** 0 is 1
    if base < 0 and not float(exponent).is_integer():
        raise ToolError("a negative number to a fractional power is not a real number")
    if exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):  # decided before computing it
        raise ToolError(f"result too large (at most {MAX_MAGNITUDE:g} in absolute value)")
    return _bounded(base ** exponent)


def _bounded(value: Number, what: str = "result") -> Number:
    if isinstance(value, complex):  # only through **, refused above; kept as a guard
        raise ToolError("result is not a real number")
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"{what} too large (at most {MAX_MAGNITUDE:g} in absolute value)")
    return value
