"""OutageRetry's view of Redis health: peers are judged dead only once Redis has been healthy for a
heartbeat TTL, and a full Redis (writes refused: heartbeats not written) counts like an outage."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError

from streamrl.common.bus import OutageRetry


@pytest.mark.parametrize("error", [RedisConnectionError("gone"), OutOfMemoryError("command not allowed")])
def test_an_outage_or_a_full_redis_restarts_the_healthy_clock(
    error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in (("_down_since", None), ("_full_since", None), ("_healthy_since", float("-inf"))):
        monkeypatch.setattr(OutageRetry, name, value)
    assert OutageRetry.healthy_for() == float("inf")  # no outage seen by this process
    calls: list[int] = []

    async def command() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise error
        return "done"

    async def on_failure(*_: Any) -> None:
        return None

    assert asyncio.run(OutageRetry(outage_s=5).call_with_retry(command, on_failure)) == "done"
    assert len(calls) == 2
    assert 0 <= OutageRetry.healthy_for() < 1.0  # just came back
