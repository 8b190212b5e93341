"""Fixtures for the coordinator's pieces against a real Redis: a run's state in the test Redis.

The hand-made inputs (config, prompt source, scored samples) are shared with the unit tier: they live in
tests/unit/coordinator/coordinator_fakes.py, put on the import path here.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from streamrl.common.bus import Bus, connect
from streamrl.common.streams import StreamNames
from streamrl.coordinator.state import RunState

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "coordinator"))


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
