"""The reward function of bench/fleet.py: cheap on purpose (the reward tier's own cost is the bus, the
decoding and the batching around the call, not the scoring). Reward 1 when the response's last
character is the label's digit, else 0."""

from __future__ import annotations

from typing import Any


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    rewards = [1.0 if query[-1:] == label[-1:] else 0.0 for query, label in zip(queries, labels, strict=True)]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
