"""Leases against real worker processes: a slow start keeps the coordinator's lease while a standby
waits, and a deposed instance (its lease taken by another token) writes nothing and stops."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import redis
from test_bus import make_trajectory
from test_leases import WORKER, _status, _stop, _wait

from streamrl.common.consumer import encode_payload
from streamrl.common.streams import StreamNames


def _start(
    redis_url: str, run_id: str, service: str, instance: str, beat_s: float, *extra: str
) -> subprocess.Popen[str]:
    url, beat = f"--redis.url={redis_url}", f"--consumer.heartbeat_interval_s={beat_s}"
    cmd = [sys.executable, str(WORKER), url, f"--run_id={run_id}", f"--instance={instance}", beat, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BUS_WORKER_SERVICE": service}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_slow_start_keeps_the_lease_while_a_standby_waits(redis_url: str, run_id: str, tmp_path: Path) -> None:
    """The first coordinator's start-up blocks its event loop until a standby has waited twice the lease
    TTL (2.5 s at a 0.5 s heartbeat; 1 s before the TTL grew): the first keeps its lease and runs, the
    standby keeps waiting."""
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    started = tmp_path / "started"
    first = _start(redis_url, run_id, "coordinator", "first", 0.5, f"--coordinator.start_blocking_until={started}")
    standby = None
    try:
        _wait(lambda: client.exists(names.lease("singleton", "coordinator")), 20, "the first to take the lease")
        standby = _start(redis_url, run_id, "coordinator", "standby", 0.5, "--standby=true")
        _wait(lambda: _status(client, names, "coordinator", "standby") is not None, 30, "the standby to start")
        time.sleep(2 * 2.5)  # the first is still starting, its event loop blocked
        started.touch()
        _wait(lambda: _status(client, names, "coordinator", "first") == "running" or first.poll() is not None, 30, "")
        time.sleep(3.0)  # over a lease TTL
        assert first.poll() is None, first.communicate(timeout=10)[0]
        assert _status(client, names, "coordinator", "first") == "running"
        assert _status(client, names, "coordinator", "standby") == "standby"
        assert client.get(names.lease("singleton", "coordinator")).decode().startswith("first@")
    finally:
        _stop(first, *([standby] if standby else []))
    assert first.returncode == 0


def test_a_deposed_instance_writes_nothing_and_stops(redis_url: str, run_id: str) -> None:
    """Its name's lease now holds another process's token: the next commit is refused (nothing written,
    the entry stays pending for the lease's holder) and the instance stops - before its own renewal,
    2 s later, would have noticed."""
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    worker = _start(redis_url, run_id, "echo", "w", 2.0)
    try:
        _wait(lambda: _status(client, names, "echo", "w") == "running", 30, "the worker to run")
        client.set(names.lease("instance", "echo", "w"), "w@another-host:1/0000", px=60_000)
        client.xadd(names.trajectories, encode_payload(make_trajectory(0)))
        out, _ = worker.communicate(timeout=30)
    finally:
        _stop(worker)
    assert worker.returncode == 1, out
    assert "held by w@another-host:1" in out
    assert client.xlen(names.scored) == 0, "a deposed instance wrote its output"
    assert client.xpending(names.trajectories, "reward")["pending"] == 1
