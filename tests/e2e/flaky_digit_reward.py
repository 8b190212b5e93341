"""digit_reward.py's dense reward (the share of digits in the response), failing the first two calls that hold certain responses.

A response is picked when the CRC-32 of its query is divisible by 8 (about one sample in eight, the
same in every run for the same text). A call whose batch holds a picked query that has failed fewer
than twice raises. The reward tier then retries the batch sample by sample (the second failure
lands on the picked sample alone) and the consumer loop redelivers that sample's entry, which
succeeds: each picked trajectory has failed reward attempts before the one that scored it, and the
scorer's failures are counted in its metrics. At most two failed deliveries per trajectory, below
the default ``max_deliveries`` of 3, so nothing is dead-lettered.
"""

from __future__ import annotations

import threading
import zlib
from collections import Counter
from typing import Any

FAILURES_PER_QUERY = 2
_failed: Counter[str] = Counter()
_lock = threading.Lock()  # the reward tier runs synchronous functions in worker threads


def picked(query: str) -> bool:
    return zlib.crc32(query.encode()) % 8 == 0


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    with _lock:
        due = [q for q in queries if picked(q) and _failed[q] < FAILURES_PER_QUERY]
        for query in set(due):
            _failed[query] += 1
    if due:
        raise RuntimeError(f"injected failure for {len(due)} picked queries")
    rewards = [
        sum(c.isdigit() for c in q[len(p) :]) / max(len(q) - len(p), 1) for q, p in zip(queries, prompts, strict=True)
    ]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
