"""Reward shaping: DAPO overlong penalty, stop-properly penalty, clipping, and their composition."""

from __future__ import annotations

import pytest
import torch

from streamrl.learner.rl.algo import shaping
from streamrl.learner.rl.algo.config import AlgoConfig
from streamrl.learner.rl.algo.objective import shape_rewards


def test_overlong_penalty_hand() -> None:
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    out = shaping.overlong_penalty(lengths, max_length=20, buffer_length=5)
    assert torch.allclose(out, torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0], dtype=torch.float64))
    assert torch.allclose(shaping.overlong_penalty(lengths, 20, 5, factor=0.5), out * 0.5)
    with pytest.raises(ValueError, match="overlong buffer"):
        shaping.overlong_penalty(lengths, max_length=20, buffer_length=21)


def test_stop_properly_penalty() -> None:
    rewards, truncated = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([True, False, True])
    assert shaping.stop_properly_penalty(rewards, truncated, 0.5).tolist() == [0.5, 2.0, -0.5]
    assert shaping.stop_properly_penalty(rewards, truncated, -1.0).tolist() == [-1.0, 2.0, -1.0]
    assert shaping.stop_properly_penalty(rewards, truncated, 0.0).tolist() == [0.0, 2.0, 0.0]


def test_clip_rewards() -> None:
    assert shaping.clip_rewards(torch.tensor([-20.0, 0.5, 20.0]), -10, 10).tolist() == [-10.0, 0.5, 10.0]
    with pytest.raises(ValueError):
        shaping.clip_rewards(torch.tensor([0.0]), 1, -1)


def test_shape_rewards_order_and_requirements() -> None:
    cfg = AlgoConfig.model_validate(
        {
            "shaping": {
                "reward_clip": [-1.0, 1.0],
                "overlong_buffer_len": 4,
                "max_response_len": 8,
                "stop_properly_penalty_coef": -0.5,
            }
        }
    )
    rewards = torch.tensor([3.0, 1.0, 1.0])
    lengths = torch.tensor([2, 6, 8])
    truncated = torch.tensor([False, False, True])
    out = shape_rewards(cfg, rewards=rewards, response_lengths=lengths, truncated=truncated)
    # overlong: [0, -0.5, -1] -> [3, 0.5, 0]; stop-properly (c < 0): truncated -> -0.5; clip -> [1, 0.5, -0.5]
    assert out.tolist() == [1.0, 0.5, -0.5]
    assert rewards.tolist() == [3.0, 1.0, 1.0]  # input untouched
    with pytest.raises(ValueError, match="response_lengths"):
        shape_rewards(cfg, rewards=rewards, truncated=truncated)
    with pytest.raises(ValueError, match="truncated"):
        shape_rewards(cfg, rewards=rewards, response_lengths=lengths)
    assert shape_rewards(AlgoConfig(), rewards=torch.tensor([11.0, -3.0])).tolist() == [10.0, -3.0]
