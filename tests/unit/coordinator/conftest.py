"""Fixtures for the coordinator's pieces: a run's state in the test Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from streamrl.common.bus import Bus, connect
from streamrl.common.streams import StreamNames
from streamrl.coordinator.state import RunState


@pytest.fixture
def in_redis(redis_url: str, run_id: str) -> Callable[[Callable[[RunState], Awaitable[Any]]], Any]:
    """``in_redis(scenario)``: run ``async scenario(state)`` against the test Redis, in a fresh run."""

    def run(scenario: Callable[[RunState], Awaitable[Any]]) -> Any:
        async def main() -> Any:
            client = connect(redis_url)
            try:
                return await scenario(RunState(Bus(client), StreamNames(run_id)))
            finally:
                await client.aclose()

        return asyncio.run(main())

    return run
