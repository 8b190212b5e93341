"""A built-in tool environment: a calculator the model calls inside its turns.

The model writes ``<calc>12+7</calc>``; the environment answers ``<result>19</result>`` (environment
tokens), and the model goes on. A turn that writes ``Answer: ...`` ends the episode, and so does a
turn with neither a call nor an answer (nothing to react to). The environment gives no reward of its
own (``reward`` 0 on every step): whether the answer is right is the reward tier's final scorer's
call on the whole episode text (``examples/multiturn/task.py``), so the same scorer gives held-out
accuracy and the training reward. ``info`` counts the calls of the step and the ones that failed.

Use it with ``[rollout.environment] path = "streamrl.rollout.environments.calculator:CalculatorEnvironment"``.

Expressions are parsed with :mod:`ast` and evaluated by walking the tree - never ``eval``: only
numbers, ``+ - * /`` (binary and unary ``+ -``) and parentheses, in exact rational arithmetic
(:class:`fractions.Fraction`). No power operator, so a value's size is bounded by the expression's
length (``max_expression_chars``); a result longer than ``max_result_chars`` is an error. Errors
(a syntax error, a name, division by zero, ...) are answered as ``<result>error: ...</result>`` so
the model sees them; they never end the episode.
"""

from __future__ import annotations

import ast
import decimal
import re
from fractions import Fraction
from typing import Any

from streamrl.rollout.environments.environment import StepResult

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
ANSWER = re.compile(r"Answer:")
DECIMAL_PLACES = 6
"""A non-integer result is shown rounded to this many decimal places (trailing zeros dropped)."""


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is shown to the model."""


def evaluate(expression: str, max_chars: int = 200) -> Fraction:
    """The exact value of ``expression`` (numbers, ``+ - * /``, parentheses); CalculatorError otherwise."""
    if len(expression) > max_chars:
        raise CalculatorError(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:  # ValueError: a NUL byte
        raise CalculatorError("syntax") from e
    except (RecursionError, MemoryError) as e:  # the parser's nesting limit
        raise CalculatorError("too deeply nested") from e
    try:
        return _value(tree.body)
    except RecursionError as e:
        raise CalculatorError("too deeply nested") from e


_BINARY = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__}


def _value(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex, str
        try:
            return Fraction(str(node.value))  # the literal as written (0.1 is 1/10); inf/nan refused
        except ValueError as e:
            raise CalculatorError("number out of range") from e
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        operand = _value(node.operand)
        return operand if isinstance(node.op, ast.UAdd) else -operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        left, right = _value(node.left), _value(node.right)
        if right == 0:
            raise CalculatorError("division by zero")
        return left / right
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left), _value(node.right))
    raise CalculatorError("only numbers, + - * / and parentheses")


def format_value(value: Fraction, max_chars: int = 40) -> str:
    """An integer as itself, anything else rounded to :data:`DECIMAL_PLACES` decimals: ``19``, ``0.333333``."""
    if abs(value) >= 10**max_chars:
        raise CalculatorError("result too large")
    if value.denominator == 1:
        text = str(value.numerator)
    else:
        with decimal.localcontext() as ctx:
            ctx.prec = max_chars + DECIMAL_PLACES + 2
            rounded = (decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)).quantize(
                decimal.Decimal(1).scaleb(-DECIMAL_PLACES)
            )
        text = format(rounded, "f").rstrip("0").rstrip(".")
        text = "0" if text in ("-0", "") else text
    if len(text) > max_chars:
        raise CalculatorError("result too large")
    return text


class CalculatorEnvironment:
    """See the module docstring. One instance per episode (it keeps no state between steps)."""

    def __init__(self, max_expression_chars: int = 200, max_result_chars: int = 40, max_calls_per_turn: int = 4):
        if min(max_expression_chars, max_result_chars, max_calls_per_turn) < 1:
            raise ValueError(
                "max_expression_chars, max_result_chars and max_calls_per_turn must be >= 1, got "
                f"{max_expression_chars}, {max_result_chars}, {max_calls_per_turn}"
            )
        self.max_expression_chars = max_expression_chars
        self.max_result_chars = max_result_chars
        self.max_calls_per_turn = max_calls_per_turn

    def reset(self, prompt: str, label: str | None, metadata: dict[str, Any]) -> None:
        return None

    def step(self, response: str) -> StepResult:
        """Answer every call of the turn (up to ``max_calls_per_turn``), or end on an answer / nothing."""
        calls = CALL.findall(response)
        if ANSWER.search(response) or not calls:
            return StepResult(
                done=True, info={"calls": 0, "errors": 0, "answered": ANSWER.search(response) is not None}
            )
        results, errors = [], 0
        for expression in calls[: self.max_calls_per_turn]:
            try:
                text = format_value(evaluate(expression, self.max_expression_chars), self.max_result_chars)
            except CalculatorError as e:
                text, errors = f"error: {e}", errors + 1
            results.append(f"<result>{text}</result>")
        return StepResult(
            observation="".join(results), info={"calls": len(results), "errors": errors, "answered": False}
        )
