"""The rollout service with the agent endpoint on a real redis-server: an agent's conversation goes out
as a trajectory with its own prompt and the agent's reward (the endpoint itself is unit-tested in
tests/unit/rollout/test_openai_server.py, whose script engine and client helpers this test reuses)."""

from __future__ import annotations

import asyncio

import numpy as np
from committed import handled as committed
from test_openai_server import ScriptEngine, chat, endpoint, ids, item, report, run, take

from streamrl.common.bus import Bus, connect
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import Trajectory
from streamrl.common.streams import StreamNames
from streamrl.rollout.agents.config import AgentEndpointConfig
from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.service import RolloutService


def test_the_service_publishes_the_conversation_with_its_own_prompt_and_the_agents_reward(
    redis_url: str, run_id: str
) -> None:
    engine = ScriptEngine()
    config = RolloutConfig(
        run_id=run_id, engine=EngineConfig(model="unused", type="hf"), agent=AgentEndpointConfig(port=0)
    )
    ctx = ServiceContext("rollout", "rollout-0", config, Bus(connect(redis_url)), StreamNames(run_id), asyncio.Event())

    async def main() -> list[Trajectory]:
        async with endpoint(engine) as (url, gateway):
            service = RolloutService(config, ctx, engine, gateway)  # type: ignore[arg-type]
            handled = asyncio.create_task(service.handle(item(n=2)))
            for reward in (0.25, 0.75):
                task = (await take(url)).json()
                await chat(task, [{"role": "system", "content": "#"}, {"role": "user", "content": task["prompt"]}])
                await report(url, task["id"], reward)
            outputs = await handled
            trajectories = await committed(service.redis, outputs)  # as the reward tier sees them
            await service.redis.aclose()
            return trajectories

    trajectories = run(main)
    assert [t.id for t in trajectories] == ["p1/0", "p1/1"]
    for t, reward in zip(trajectories, (0.25, 0.75), strict=True):
        assert t.prompt_ids.tolist() == ids("<|system|>#<|user|>12+34=<|assistant|>")
        assert t.prompt_text == "<|system|>#<|user|>12+34=<|assistant|>"
        assert t.response_ids.tolist() == ids("42</s>") and t.loss_mask.tolist() == [1, 1, 1]
        assert np.allclose(t.logprobs.to_numpy(), [-0.11, -0.12, -0.13])  # positions 10-12 after a prompt of 10
        assert t.metadata == {"source": "test", "env_info": [], "agent_reward": reward}
        assert (t.label, t.group_size, t.stop_reason, t.policy_version_start) == ("46", 2, "done", 3)
        assert [(turn.start, turn.end) for turn in t.turns] == [(0, 3)]
