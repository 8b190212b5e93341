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


def test_an_endless_outage_retry_outlasts_any_count_of_failures() -> None:
    """``outage_s = inf`` (a learner's lane clients): retried until Redis answers, where a finite window gives up."""
    from redis.backoff import NoBackoff

    def failing(times: int) -> Any:
        calls: list[int] = []

        async def command() -> str:
            calls.append(1)
            if len(calls) <= times:
                raise RedisConnectionError("connection refused")
            return "done"

        return command

    async def on_failure(*_: Any) -> None:
        return None

    finite, endless = OutageRetry(outage_s=4), OutageRetry(outage_s=float("inf"))
    for retry in (finite, endless):
        retry._backoff = NoBackoff()  # the count of tries is what differs, not the waiting
    with pytest.raises(RedisConnectionError):
        asyncio.run(finite.call_with_retry(failing(50), on_failure))
    assert asyncio.run(endless.call_with_retry(failing(50), on_failure)) == "done"
