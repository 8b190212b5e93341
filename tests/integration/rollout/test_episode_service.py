"""The rollout service with an environment on a real redis-server: episodes go out as multi-turn
trajectories (the episode itself is unit-tested in tests/unit/rollout/test_episode.py, whose script
engine and work items these tests reuse)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
from committed import handled
from test_episode import Failing, ScriptEngine, calculator_script, detokenize, item, spans, tokenize

from streamrl.common.bus import Bus, connect
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import PromptWorkItem, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.rollout.config import EnvironmentConfig, RolloutConfig
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.environments.calculator import CalculatorEnvironment
from streamrl.rollout.environments.episode import EpisodeRunner
from streamrl.rollout.service import RolloutService


@pytest.fixture
def service(redis_url: str, run_id: str) -> Iterator[RolloutService]:
    engine = ScriptEngine(calculator_script)
    env = EnvironmentConfig(path="streamrl.rollout.environments.calculator:CalculatorEnvironment", max_turns=2)
    config = RolloutConfig(run_id=run_id, engine=EngineConfig(model="unused", type="hf"), environment=env)
    ctx = ServiceContext("rollout", "rollout-0", config, Bus(connect(redis_url)), StreamNames(run_id), asyncio.Event())
    runner = EpisodeRunner(engine, CalculatorEnvironment, tokenize, env, max_model_len=64)  # type: ignore[arg-type]
    yield RolloutService(config, ctx, engine, runner)  # type: ignore[arg-type]


def handle(service: RolloutService, work: PromptWorkItem) -> list[Trajectory]:
    async def main() -> list[Trajectory]:
        try:
            return await handled(service.redis, await service.handle(work))  # as the reward tier receives them
        finally:
            await service.redis.aclose()

    return asyncio.run(main())


def test_the_service_sends_episodes_as_multi_turn_trajectories(service: RolloutService) -> None:
    trajectories = handle(service, item(n=2))
    assert [t.id for t in trajectories] == ["p1/0", "p1/1"]
    for t in trajectories:
        ids, mask = t.response_ids.tolist(), t.loss_mask.tolist()
        assert detokenize(ids) == t.response_text == "<calc>12+7</calc><result>19</result>Answer: 19"
        assert t.loss_mask.dtype == "uint8" and [(m, s, e) for m, s, e in spans(mask)] == [
            (1, 0, 18),
            (0, 18, 37),
            (1, 37, 48),
        ]
        assert [(turn.start, turn.end) for turn in t.turns] == [(0, 18), (37, 48)]
        assert np.all(t.logprobs.to_numpy()[np.asarray(mask) == 0] == 0)
        assert (t.stop_reason, t.finish_reason, t.truncated) == ("done", "stop", False)
        assert t.metadata == {
            "source": "test",
            "env_info": [{"calls": 1, "errors": 0, "answered": False}, {"calls": 0, "errors": 0, "answered": True}],
        }


def test_the_service_keeps_an_environment_error_in_the_metadata(service: RolloutService) -> None:
    assert service.episodes is not None
    service.episodes.make_environment = lambda: Failing("raise")
    (t,) = handle(service, item())
    assert (
        t.stop_reason == "error" and t.metadata["env_error"] == "step of turn 1 raised ZeroDivisionError: in the tool"
    )
    assert [turn.reward for turn in t.turns] == [0.25, 0.0]
