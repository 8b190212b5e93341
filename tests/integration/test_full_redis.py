"""A service rides out a Redis at its ``maxmemory`` (``noeviction``: every write answered ``OOM``):
its heartbeat, lease renewals and commits wait and go through once memory is freed - nothing
dead-lettered, nothing lost, the process never stops. Real redis-server, real worker process."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import redis
from test_bus import make_trajectory, pending, scored_ids, start_worker, wait_for

from streamrl.common.consumer import encode_payload
from streamrl.common.streams import StreamNames
from streamrl.ops.redis_server import RedisServer


def test_a_service_rides_out_a_full_redis(tmp_path: Path, run_id: str) -> None:
    server = RedisServer(tmp_path, appendonly=False).start()
    names = StreamNames(run_id)
    admin = redis.Redis.from_url(server.url)
    worker = start_worker(server.url, run_id, "w", "--redis.outage_s=30", "--echo.delay_s=1")
    try:
        wait_for(lambda: admin.exists(names.heartbeat("echo", "w")), 30, "the worker to run")
        admin.set("ballast", b"x" * 4_000_000)
        for i in range(10):
            admin.xadd(names.trajectories, encode_payload(make_trajectory(i)))
        time.sleep(0.5)  # the 4 MB query buffer of that SET is freed: used_memory settles
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) - 1_000_000)  # full before the commits
        time.sleep(4.0)  # heartbeats (TTL 0.4 s), lease renewals and commits all refused meanwhile
        assert worker.poll() is None, "the worker stopped on a full redis"
        assert admin.xlen(names.scored) == 0 and admin.xlen(names.dead) == 0
        admin.delete("ballast")  # memory freed
        wait_for(lambda: len(scored_ids(admin, names)) == 10 and pending(admin, names) == 0, 30, "all outputs")
        assert sorted(scored_ids(admin, names)) == sorted(f"g{i}/0" for i in range(10))
        assert admin.xlen(names.dead) == 0 and worker.poll() is None
        log = worker.log_path.read_text()  # type: ignore[attr-defined]
        assert log.count("redis is full") == 1 and "accepts writes again" in log, log[-3000:]
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(30)
        admin.close()
        server.stop()
    assert code == 0
