"""Fixtures of the reward unit tests: a trajectory factory."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from streamrl.common.messages import Tensor, Trajectory


def make_trajectory(i: int, response: str = "", label: str | None = None, prompt: str = "Q: ") -> Trajectory:
    return Trajectory(
        id=f"g{i // 4}/{i % 4}",
        group_id=f"g{i // 4}",
        group_index=i % 4,
        group_size=4,
        prompt_ids=Tensor.from_list([1, 2, 3], "int32"),
        response_ids=Tensor.from_list([4, 5], "int32"),
        logprobs=Tensor.from_list([-0.5, -0.25], "float32"),
        loss_mask=Tensor.from_list([1, 1], "uint8"),
        prompt_text=prompt,
        response_text=response or f"answer {i}",
        label=label,
        metadata={"idx": i},
        traceparent=f"00-{i:032x}-{i:016x}-01",
    )


@pytest.fixture
def traj() -> Callable[..., Trajectory]:
    return make_trajectory
