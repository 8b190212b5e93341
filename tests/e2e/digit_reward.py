"""A dense reward for pipeline tests on a random model: the share of digits in the response.

The arithmetic reward is 0 for every sample of an untrained model, so GRPO would get no signal;
this one varies from the first step, so the weights (and the greedy outputs) move.
"""

from __future__ import annotations

from typing import Any


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    rewards = []
    for query, prompt in zip(queries, prompts, strict=True):
        response = query[len(prompt) :]
        rewards.append(sum(c.isdigit() for c in response) / max(len(response), 1))
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
