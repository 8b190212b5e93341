"""The built-in calculator environment: exact arithmetic from an ast walk, nothing else evaluated."""

from __future__ import annotations

from fractions import Fraction

import pytest

from streamrl.rollout.environments.calculator import CalculatorEnvironment, CalculatorError, evaluate, format_value
from streamrl.rollout.environments.environment import StepResult


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("12+7", Fraction(19)),
        (" 47 * 85 ", Fraction(3995)),
        ("(1+2)*(3-4)", Fraction(-3)),
        ("-(2+3)*+4", Fraction(-20)),
        ("1/3+1/6", Fraction(1, 2)),
        ("0.1+0.2", Fraction(3, 10)),  # exact: the literals as written
        ("10/4", Fraction(5, 2)),
        ("2-3*4/6", Fraction(0)),
    ],
)
def test_arithmetic_is_exact(expression: str, value: Fraction) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "only numbers"),
        ("x+1", "only numbers"),
        ("2**100", "only numbers"),
        ("7//2", "only numbers"),
        ("7%2", "only numbers"),
        ("True+1", "only numbers"),
        ("'a'*3", "only numbers"),
        ("1j*1j", "only numbers"),
        ("1<2", "only numbers"),
        ("(lambda: 1)()", "only numbers"),
        ("[1][0]", "only numbers"),
        ("1e999", "number out of range"),
        ("1/(2-2)", "division by zero"),
        ("1+", "syntax"),
        ("", "syntax"),
        ("1\x00", "syntax"),
        ("1;2", "syntax"),
        ("1" * 201, "longer than 200"),
    ],
)
def test_anything_else_is_refused(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=message):
        evaluate(expression)


def test_nesting_and_result_size_are_bounded() -> None:
    with pytest.raises(CalculatorError, match="syntax"):  # the parser's own limit on parentheses
        evaluate("(" * 300 + "1" + ")" * 300, max_chars=1000)
    for deep in ("-" * 2000 + "1", "+".join(["1"] * 3000)):  # deeper than the interpreter's stack
        with pytest.raises(CalculatorError, match="too deeply nested"):
            evaluate(deep, max_chars=10**5)
    assert evaluate("(" * 90 + "1" + ")" * 90) == 1
    with pytest.raises(CalculatorError, match="result too large"):
        format_value(evaluate("99999999999*99999999999"), max_chars=20)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (Fraction(19), "19"),
        (Fraction(-7), "-7"),
        (Fraction(1, 3), "0.333333"),
        (Fraction(-5, 2), "-2.5"),
        (Fraction(2, 3), "0.666667"),
        (Fraction(1, 10**9), "0"),
        (Fraction(-1, 10**9), "0"),
    ],
)
def test_results_are_shown_as_integers_or_rounded_decimals(value: Fraction, text: str) -> None:
    assert format_value(value) == text


def test_a_turn_with_calls_gets_their_results() -> None:
    env = CalculatorEnvironment()
    assert env.reset("12+7=", "19", {}) is None
    assert env.step("<calc>12+7</calc>") == StepResult(
        observation="<result>19</result>", info={"calls": 1, "errors": 0, "answered": False}
    )
    result = env.step("first <calc>1/0</calc> then <calc>2*3</calc>")
    assert result.observation == "<result>error: division by zero</result><result>6</result>"
    assert not result.done and result.reward == 0.0 and result.info == {"calls": 2, "errors": 1, "answered": False}


def test_an_answer_or_a_turn_without_a_call_ends_the_episode() -> None:
    env = CalculatorEnvironment()
    assert env.step("Answer: 19") == StepResult(done=True, info={"calls": 0, "errors": 0, "answered": True})
    assert env.step("<calc>1+1</calc> Answer: 2").done
    assert env.step("19") == StepResult(done=True, info={"calls": 0, "errors": 0, "answered": False})


def test_limits_of_the_environment() -> None:
    env = CalculatorEnvironment(max_expression_chars=5, max_result_chars=3, max_calls_per_turn=2)
    result = env.step("<calc>123456</calc><calc>99*99</calc><calc>1+1</calc>")
    assert (
        result.observation
        == "<result>error: expression longer than 5 characters</result><result>error: result too large</result>"
    )
    with pytest.raises(ValueError, match="must be >= 1"):
        CalculatorEnvironment(max_calls_per_turn=0)
