"""Heartbeats: each instance keeps a key with a TTL fresh; ``--check`` reads it for health checks."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable

import redis as syncredis
import redis.asyncio as aioredis

from streamrl.common.codec import decode, encode
from streamrl.common.messages import Heartbeat
from streamrl.common.replies import raw, text
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
    snapshot: Callable[[], dict[str, int | str | float]],
    before_beat: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Write the heartbeat every ``interval_s`` with TTL ``2 * interval_s`` until cancelled; the
    instance is (re-)registered in ``names.instances`` with every beat. ``before_beat`` (renewing the
    instance's leases) runs first each time: if it raises, the beats stop with its error."""
    key = names.heartbeat(service, instance)
    ttl_ms = int(2 * interval_s * 1000)
    while True:
        if before_beat is not None:
            await before_beat()
        beat = Heartbeat(service=service, instance=instance, pid=os.getpid(), ts=time.time(), **snapshot())  # type: ignore[arg-type]
        pipe = redis.pipeline(transaction=False)
        pipe.set(key, encode(beat), px=ttl_ms)
        pipe.sadd(names.instances, f"{service}:{instance}")
        await pipe.execute()
        await asyncio.sleep(interval_s)


def live_heartbeats(client: syncredis.Redis, names: StreamNames, service: str = "*") -> list[Heartbeat]:
    """Live heartbeats of ``service`` (``*`` = every service), sorted by service and instance.

    Looked up through the ``instances`` set, so the cost does not grow with the keyspace. An
    instance whose key expired is left out
    but stays in the set: a consumer loop judges its entries by it (the one that takes them over
    removes it, :meth:`streamrl.common.consumer.ConsumerLoop._reclaim_from_the_dead`); one that
    stopped cleanly removed itself."""
    keys = _heartbeat_keys(client.smembers(names.instances), names, service)
    return _decode_beats(client.mget(keys)) if keys else []


async def live_heartbeats_async(redis: aioredis.Redis, names: StreamNames, service: str = "*") -> list[Heartbeat]:
    """:func:`live_heartbeats` on an asyncio client (two round trips)."""
    keys = _heartbeat_keys(await redis.smembers(names.instances), names, service)
    return _decode_beats(await redis.mget(keys)) if keys else []


def _heartbeat_keys(members: Iterable[bytes | str], names: StreamNames, service: str) -> list[str]:
    """The heartbeat keys of the ``instances`` members (``service:instance``) of ``service``, sorted."""
    found = sorted(text(m) for m in members)
    if service != "*":
        found = [m for m in found if m.split(":", 1)[0] == service]
    return [names.heartbeat(*m.split(":", 1)) for m in found]


def _decode_beats(values: list[bytes | str | None]) -> list[Heartbeat]:
    return [decode(raw(value), Heartbeat) for value in values if value]


def read_heartbeats(redis_url: str, names: StreamNames, service: str = "*") -> list[Heartbeat]:
    """All live heartbeats of ``service`` (``*`` = every service)."""
    client = syncredis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        return live_heartbeats(client, names, service)
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
