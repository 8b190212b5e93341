"""Reward function for agent-driven runs: the reward the agent reported for each conversation.

The rollout tier's OpenAI endpoint puts it in the trajectory's ``metadata["agent_reward"]``
(docs/agents.md); this returns it as the reward, and clipped to [0, 1] as the score. Pure Python,
loaded by path: ``[[reward.scorers]] type = "function", path = "examples/agent/agent_reward.py"``.
"""

from __future__ import annotations

from typing import Any


def reward_func(
    queries: list[str], prompts: list[str], labels: list[str | None], metadata: list[dict[str, Any]], **kwargs: Any
) -> dict[str, Any]:
    rewards = [float(m["agent_reward"]) for m in metadata]
    return {"rewards": rewards, "scores": [min(1.0, max(0.0, r)) for r in rewards], "extra_logs": {}}
