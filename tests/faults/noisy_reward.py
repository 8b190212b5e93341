"""Reward function of the weight-delta scenario: 0 or 1 by the query's CRC-32, so every group has
advantages and the learner's weights move each step (the tiny random model earns 0 from the arithmetic
task, which leaves the weights unchanged). The same answer on every delivery."""

from __future__ import annotations

import zlib
from typing import Any


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    rewards = [float(zlib.crc32(q.encode()) % 2) for q in queries]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
