"""A reward function that takes 0.1 s per call whatever the batch (an external judge's latency): a
reward replica with few entries in flight has a known, small throughput, so a burst builds a backlog."""

from __future__ import annotations

import time
from typing import Any


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    time.sleep(0.1)
    rewards = [float(len(q) % 2) for q in queries]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
