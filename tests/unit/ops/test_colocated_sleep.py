"""``rollout.engine.sleep_between_versions`` is for colocated synchronous runs: ``streamrl up`` refuses a
recipe that asks for it with a staleness above 0 or with weights that do not stay on the GPU (CUDA IPC)."""

from __future__ import annotations

from typing import Any

import pytest

from streamrl.common.config import validate
from streamrl.common.errors import ConfigError
from streamrl.ops.up_config import LaunchRecipe, colocated_sleep_problem


def _recipe(sleep: bool = True, staleness: int | None = 0, transport: str | None = "ipc") -> dict[str, Any]:
    data: dict[str, Any] = {"rollout": {"engine": {"model": "m", "sleep_between_versions": sleep}}}
    if staleness is not None:
        data["coordinator"] = {"max_staleness": staleness}
    if transport is not None:
        data["learner"] = {"weights_transport": transport}
    return data


def test_a_colocated_synchronous_recipe_may_sleep_the_engine() -> None:
    assert colocated_sleep_problem(_recipe()) is None
    assert colocated_sleep_problem(_recipe(staleness=None)) is None  # max_staleness defaults to 0
    assert colocated_sleep_problem(_recipe(sleep=False, staleness=2, transport="zmq")) is None
    assert colocated_sleep_problem({}) is None
    validate(LaunchRecipe, _recipe(), source="recipe")


@pytest.mark.parametrize(
    ("recipe", "problem"),
    [
        (_recipe(staleness=1), r"coordinator\.max_staleness = 0, it is 1"),
        (_recipe(transport="zmq"), r"learner\.weights_transport = 'ipc' \(colocated\), it is 'zmq'"),
        (_recipe(transport=None), r"learner\.weights_transport = 'ipc' \(colocated\), it is 'zmq'"),  # the default
        (_recipe(transport="broadcast"), r"it is 'broadcast'"),
    ],
)
def test_sleeping_the_engine_elsewhere_is_refused_naming_the_field(recipe: dict[str, Any], problem: str) -> None:
    message = colocated_sleep_problem(recipe)
    assert message is not None and message.startswith("rollout.engine.sleep_between_versions")
    with pytest.raises(ConfigError, match=problem):
        validate(LaunchRecipe, recipe, source="recipe")
