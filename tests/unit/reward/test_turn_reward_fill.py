"""How the reward tier fills a multi-turn episode's rewards: the scorers' reward is the final one,
added to the last turn's environment reward; ``reward`` is the sum of ``turn_rewards``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest

from streamrl.common.messages import ScoredTrajectory, Trajectory, Turn
from streamrl.common.streams import StreamNames
from streamrl.reward.config import RewardConfig
from streamrl.reward.scorers.base import ScorerResult
from streamrl.reward.service import RewardService, episode_rewards


class ConstantScorer:
    """Every trajectory scores ``reward`` (score 1)."""

    reads_tokens = False
    name = "final"

    def __init__(self, reward: float) -> None:
        self.reward = reward

    async def score(self, batch: list[Trajectory]) -> ScorerResult:
        return ScorerResult(rewards=[self.reward] * len(batch), scores=[1.0] * len(batch), extra=[{}] * len(batch))

    def metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None


def score(trajectory: Trajectory, final: float) -> ScoredTrajectory:
    config = RewardConfig(scorers=[{"type": "function", "name": "final", "path": "unused.py", "weight": 2.0}])
    service = RewardService(config, StreamNames("r"), scorers=[ConstantScorer(final)])

    async def main() -> ScoredTrajectory:
        (out,) = await service.handle(trajectory)
        await service.close()
        assert isinstance(out.message, ScoredTrajectory)
        return out.message

    return asyncio.run(main())


def test_the_final_reward_joins_the_last_turn(traj: Callable[..., Trajectory]) -> None:
    turns = [Turn(start=0, end=1, policy_version=0, reward=0.5), Turn(start=1, end=2, policy_version=0, reward=0.25)]
    scored = score(msgspec.structs.replace(traj(0), turns=turns), final=1.5)
    assert scored.turn_rewards == [0.5, 0.25 + 2 * 1.5]  # the scorer's weight applies to its own reward only
    assert scored.reward == pytest.approx(sum(scored.turn_rewards)) and scored.score == 1.0


def test_single_turn_trajectories_are_scored_as_before(traj: Callable[..., Trajectory]) -> None:
    scored = score(traj(0), final=1.5)
    assert (scored.reward, scored.turn_rewards) == (3.0, [])
    assert episode_rewards(traj(0), 1.5) == []
