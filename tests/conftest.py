"""Shared fixtures: a real redis-server on a free port (session-wide), a unique run id per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from streamrl.common.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def run_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"
