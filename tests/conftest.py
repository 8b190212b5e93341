"""Shared fixtures: a real redis-server on a free port (session-wide), a unique run id per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from streamrl.common.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server: the one CI started (``STREAMRL_TEST_REDIS_URL``), else one on a free port."""
    if os.environ.get("STREAMRL_TEST_REDIS_URL"):
        yield os.environ["STREAMRL_TEST_REDIS_URL"]
        return
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server.url
    server.stop()


@pytest.fixture
def run_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"
