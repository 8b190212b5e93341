"""A service started while its Redis is still down waits for it (``resolve_url``, the first thing a lane's
service and the learner ask), instead of failing at once with "lost redis for more than 60 s"."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from streamrl.common.lanes import resolve_url
from streamrl.ops.redis_server import RedisServer, free_port


def test_resolve_url_waits_for_a_redis_that_starts_late(tmp_path: Path) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = RedisServer(tmp_path, port=port)
    started = threading.Timer(1.5, server.start)  # refused until then
    started.start()
    try:
        assert asyncio.run(resolve_url(url, "streamrl:{run}:prompts", outage_s=60)) == url
    finally:
        started.join()
        server.stop()


def test_resolve_url_gives_up_after_its_outage_window(tmp_path: Path) -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing ever listens
    with pytest.raises(RedisConnectionError):
        asyncio.run(resolve_url(url, "streamrl:{run}:prompts", outage_s=1))


def test_the_learners_lane_client_outlasts_the_home_outage_window(tmp_path: Path) -> None:
    """The learner reads a joined batch's payloads from their lane's Redis: that Redis down for longer than
    ``redis.outage_s`` (here 1 s; 4 s down) is waited out, never an exit (the lane's data is durable and
    needed in order; a restarted learner would wait for the same lane)."""
    from streamrl.common.bus import connect
    from streamrl.common.config import RedisConfig
    from streamrl.common.lanes import LanesConfig
    from streamrl.learner.rl.lanes import close_lanes, connect_lanes

    home = RedisServer(tmp_path / "home").start()
    lane_port = free_port()
    lane = RedisServer(tmp_path / "lane", port=lane_port, appendonly=True).start()
    lane_url = f"redis://127.0.0.1:{lane_port}/0"
    restarted: list[RedisServer] = []
    redis_config = RedisConfig(url=home.url, outage_s=1)
    lanes_config = LanesConfig(count=2, urls=[home.url, lane_url])

    async def scenario() -> bytes | None:
        home_client = connect(home.url, outage_s=1)
        clients = await connect_lanes(home_client, "run", lanes_config, redis_config)
        try:
            key = "streamrl:{run/lane1}:batched:x"
            await clients.for_key(key).set(key, b"payload")
            lane.stop()
            again = RedisServer(tmp_path / "lane", port=lane_port, appendonly=True)
            back = threading.Timer(4.0, lambda: restarted.append(again.start()))
            back.start()
            try:
                return await clients.for_key(key).get(key)  # waits through the outage
            finally:
                back.join()
        finally:
            await close_lanes(clients)
            await home_client.aclose()

    try:
        assert asyncio.run(scenario()) == b"payload"
    finally:
        for server in (home, lane, *restarted):
            server.stop()
