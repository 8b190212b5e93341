"""Heartbeats: each instance keeps a key with a TTL fresh; ``--check`` reads it for health checks."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable

import redis as syncredis
import redis.asyncio as aioredis

from streamrl.common.codec import decode, encode
from streamrl.common.messages import Heartbeat
from streamrl.common.streams import StreamNames


def default_instance() -> str:
    """Instance name: ``STREAMRL_INSTANCE`` or ``{hostname}-{pid}`` (unique per container replica)."""
    return os.environ.get("STREAMRL_INSTANCE") or f"{socket.gethostname()}-{os.getpid()}"


async def heartbeat_forever(
    redis: aioredis.Redis,
    names: StreamNames,
    service: str,
    instance: str,
    interval_s: float,
    snapshot: Callable[[], dict[str, int | str]],
) -> None:
    """Write the heartbeat every ``interval_s`` with TTL ``2 * interval_s`` until cancelled."""
    key = names.heartbeat(service, instance)
    ttl_ms = int(2 * interval_s * 1000)
    while True:
        beat = Heartbeat(service=service, instance=instance, pid=os.getpid(), ts=time.time(), **snapshot())  # type: ignore[arg-type]
        await redis.set(key, encode(beat), px=ttl_ms)
        await asyncio.sleep(interval_s)


def read_heartbeats(redis_url: str, names: StreamNames, service: str = "*") -> list[Heartbeat]:
    """All live heartbeats of ``service`` (``*`` = every service)."""
    client = syncredis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        keys = sorted(client.scan_iter(match=names.heartbeat_pattern(service)))
        beats = []
        for key in keys:
            raw = client.get(key)
            if raw:
                beats.append(decode(raw, Heartbeat))
        return beats
    finally:
        client.close()


def check(redis_url: str, names: StreamNames, service: str, instance: str | None = None) -> int:
    """Exit code for a health check: 0 if the instance (or, without one, any instance) is alive."""
    try:
        beats = read_heartbeats(redis_url, names, service)
    except (syncredis.RedisError, OSError) as e:
        print(f"unhealthy: cannot reach redis: {e}")
        return 1
    if instance is None:  # a container checks its own replica: instances are named {hostname}-...
        host = socket.gethostname()
        mine = [b for b in beats if b.instance.startswith(f"{host}-") or b.instance == host]
        alive = mine
    else:
        alive = [b for b in beats if b.instance == instance]
    if not alive:
        print(f"unhealthy: no heartbeat for {service}" + (f"/{instance}" if instance else ""))
        return 1
    for b in alive:
        print(f"healthy: {b.service}/{b.instance} status={b.status} processed={b.processed} version={b.policy_version}")
    return 0
