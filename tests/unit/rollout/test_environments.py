"""Loading an environment plug-in by path, and what its calls may return."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from streamrl.rollout.environments.calculator import CalculatorEnvironment
from streamrl.rollout.environments.environment import (
    EnvironmentCallError,
    StepResult,
    as_step_result,
    call,
    load_environment,
)

PLUGIN = """
class Environment:
    def __init__(self, greeting="hi"):
        self.greeting = greeting

    def reset(self, prompt, label, metadata):
        return self.greeting

    def step(self, response):
        return {"observation": "", "reward": 1, "done": True}


class Other(Environment):
    pass


NOT_A_CLASS = 3


class NoStep:
    def reset(self, prompt, label, metadata):
        return None
"""


@pytest.fixture
def plugin(tmp_path: Path) -> Path:
    path = tmp_path / "env.py"
    path.write_text(PLUGIN)
    return path


def test_a_class_loads_from_a_file_or_a_module(plugin: Path) -> None:
    factory = load_environment(str(plugin))  # the default class name
    env = factory()
    assert type(env).__name__ == "Environment" and env.greeting == "hi"
    assert load_environment(f"{plugin}:Other", {"greeting": "yo"})().reset("p", None, {}) == "yo"
    builtin = load_environment(
        "streamrl.rollout.environments.calculator:CalculatorEnvironment", {"max_calls_per_turn": 2}
    )
    assert builtin.cls is CalculatorEnvironment and builtin().max_calls_per_turn == 2
    assert factory() is not factory(), "one instance per episode"


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("{plugin}:Missing", {}, "is nothing, not a class"),
        ("{plugin}:NOT_A_CLASS", {}, "is a int, not a class"),
        ("{plugin}:NoStep", {}, "has no step method"),
        ("{plugin}", {"colour": "red"}, r"options \['colour'\] do not fit"),
        ("{plugin}.missing.py", {}, "file not found"),
        ("no_such_package.envs:Env", {}, "module 'no_such_package.envs' not found"),
    ],
)
def test_a_bad_path_or_options_fail_naming_the_field(plugin: Path, spec: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        load_environment(spec.format(plugin=plugin), options)
    assert "rollout.environment." in str(raised.value)


def test_step_results_are_checked() -> None:
    assert as_step_result({"observation": "x", "done": False}) == StepResult("x", 0.0, False, {})
    assert as_step_result({"observation": None, "reward": 2}) == StepResult("", 2.0, False, {})
    assert as_step_result(StepResult(reward=1, info={"n": [1, "a"]})).reward == 1.0
    for bad, message in [
        ((1, 2), "a tuple, not a StepResult"),
        ({"obs": "x"}, "unknown keys"),
        ({"observation": 3}, "observation of type int"),
        ({"reward": float("nan")}, "not a finite number"),
        ({"reward": True}, "not a finite number"),
        ({"reward": "1"}, "not a finite number"),
        ({"done": 1}, "not a bool"),
        ({"info": [1]}, "info of type list"),
        ({"info": {"f": object()}}, "cannot go in a message"),
    ]:
        with pytest.raises(EnvironmentCallError, match=message):
            as_step_result(bad)


class Methods:
    def __init__(self) -> None:
        self.thread: str | None = None

    def sync(self, x: int) -> int:
        import threading

        self.thread = threading.current_thread().name
        return x + 1

    async def async_(self, x: int) -> int:
        await asyncio.sleep(0)
        return x + 2

    def slow(self) -> None:
        time.sleep(0.3)

    async def hang(self) -> None:
        await asyncio.sleep(10)

    def broken(self) -> None:
        raise KeyError("boom")


def test_calls_run_sync_methods_in_a_thread_and_become_domain_errors() -> None:
    m = Methods()

    async def main() -> None:
        assert await call(m.sync, 1, timeout_s=5, what="step") == 2
        assert m.thread is not None and m.thread != "MainThread"
        assert await call(m.async_, 1, timeout_s=5, what="step") == 3
        for method, message in [
            (m.slow, "step timed out after 0.05 s"),
            (m.hang, "step timed out after 0.05 s"),
            (m.broken, "step raised KeyError: 'boom'"),
        ]:
            with pytest.raises(EnvironmentCallError, match=message):
                await call(method, timeout_s=0.05, what="step")

    asyncio.run(main())
