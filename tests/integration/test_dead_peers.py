"""Taking over a dead peer's entries, against a real redis-server: the consumer deleted only together
with the check that it holds nothing, and no peer judged dead right after a Redis blip."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from test_bus import make_trajectory

from streamrl.common.bus import Bus, OutageRetry, Output, connect
from streamrl.common.config import ConsumerConfig
from streamrl.common.consumer import ConsumerLoop, encode_payload
from streamrl.common.messages import Trajectory
from streamrl.common.streams import StreamNames
from streamrl.ops.redis_server import RedisServer

INTERVAL_S = 0.2
"""Heartbeat interval of the test loops (heartbeat TTL 0.4 s)."""


async def _nothing(_: Trajectory) -> list[Output]:
    return []


def _loop(bus: Bus, names: StreamNames) -> ConsumerLoop[Trajectory]:
    return ConsumerLoop(
        bus,
        names,
        stream=names.trajectories,
        group="reward",
        consumer="alive",
        handler=_nothing,
        message_type=Trajectory,
        config=ConsumerConfig(heartbeat_interval_s=INTERVAL_S, claim_idle_ms=60_000),
    )


def _setup_dead_peer(client: redis.Redis, names: StreamNames, entries: int) -> list[bytes]:
    """A consumer ``dead`` registered as instance ``echo:dead``, holding the first entry; no heartbeat."""
    client.xgroup_create(names.trajectories, "reward", id="0", mkstream=True)
    ids = [client.xadd(names.trajectories, encode_payload(make_trajectory(i))) for i in range(entries)]
    client.xreadgroup("reward", "dead", {names.trajectories: ">"}, count=1)
    client.sadd(names.instances, "echo:dead")
    return ids


def _held_by(client: redis.Redis, names: StreamNames, consumer: str) -> list[bytes]:
    held = client.xpending_range(names.trajectories, "reward", min="-", max="+", count=100, consumername=consumer)
    return [h["message_id"] for h in held]


class _ReadBetween:
    """The Redis client of the loop, with the 'dead' consumer - alive after all - reading a new entry
    right after the loop found it holding nothing (before the delete)."""

    def __init__(self, real: Any, sync: redis.Redis, names: StreamNames) -> None:
        self.real, self.sync, self.names, self.read = real, sync, names, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def read_as_dead(self) -> None:
        if not self.read:
            self.read = True
            self.sync.xreadgroup("reward", "dead", {self.names.trajectories: ">"}, count=1)

    async def xpending_range(self, *args: Any, **kwargs: Any) -> Any:
        held = await self.real.xpending_range(*args, **kwargs)
        if kwargs.get("consumername") == "dead" and kwargs.get("count") == 1 and not held:
            self.read_as_dead()  # the check said "nothing left"; the delete comes next
        return held


def test_a_consumer_that_reads_between_check_and_delete_keeps_its_entry(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    ids = _setup_dead_peer(client, names, entries=2)

    async def main() -> None:
        bus = Bus(connect(redis_url))
        loop = _loop(bus, names)
        between = _ReadBetween(bus.redis, client, names)
        loop.redis = between  # type: ignore[assignment]
        forget = getattr(loop, "_forget", None)
        if forget is not None:  # the check and the delete are one script: the read can only come before it

            async def read_then_forget(**kwargs: Any) -> Any:
                between.read_as_dead()
                return await forget(**kwargs)

            loop._forget = read_then_forget  # type: ignore[attr-defined]
        time.sleep(2 * INTERVAL_S)  # entries idle one heartbeat interval: claimable
        for _ in range(3):  # looks one heartbeat interval apart
            await loop._reclaim_from_the_dead()
            await asyncio.sleep(INTERVAL_S)
        await loop.drain()
        await bus.redis.aclose()

    asyncio.run(main())
    pel = client.xpending_range(names.trajectories, "reward", min="-", max="+", count=100)
    assert ids[1] in [h["message_id"] for h in pel], "the entry read between check and delete was dropped"


def test_no_peer_is_judged_dead_right_after_a_redis_blip(
    tmp_path: Path, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis down longer than a heartbeat TTL: every heartbeat expired. Once it is back, the peer
    beats again within an interval; the loop must not have taken its entries meanwhile. A peer that
    stays silent is taken once Redis has been healthy for a heartbeat TTL (two looks apart)."""
    monkeypatch.setattr(OutageRetry, "_healthy_since", float("-inf"), raising=False)
    server = RedisServer(tmp_path, appendonly=True).start()
    names = StreamNames(run_id)
    client = redis.Redis.from_url(server.url)
    _setup_dead_peer(client, names, entries=1)

    async def main() -> tuple[list[bytes], list[bytes]]:  # what "dead" holds after the blip, and at the end
        bus = Bus(connect(server.url, outage_s=30))
        loop = _loop(bus, names)
        server.stop()  # the blip: 1 s, over the 0.4 s heartbeat TTL
        restart = asyncio.create_task(asyncio.to_thread(lambda: (time.sleep(1.0), server.start())))
        await bus.redis.ping()  # waits through the outage (the client's retry)
        await restart
        client.delete(names.heartbeat("echo", "dead"))  # expired during the blip
        for _ in range(2):  # right after the blip, two looks an interval apart: the peer is not beating yet
            await loop._reclaim_from_the_dead()
            await asyncio.sleep(INTERVAL_S)
        after_blip = _held_by(client, names, "dead")
        client.set(names.heartbeat("echo", "dead"), b"x", px=int(2000 * INTERVAL_S))  # it beats again
        for _ in range(3):
            await loop._reclaim_from_the_dead()
            await asyncio.sleep(INTERVAL_S)
        await asyncio.sleep(4 * INTERVAL_S)  # now it stops for good (its key expires)
        for _ in range(3):
            await loop._reclaim_from_the_dead()
            await asyncio.sleep(INTERVAL_S)
        taken = _held_by(client, names, "dead")
        await loop.drain()
        await bus.redis.aclose()
        return after_blip, taken

    try:
        after_blip, taken = asyncio.run(main())
    finally:
        client.close()
        server.stop()
    assert len(after_blip) == 1, "a live peer's entries were taken right after the blip"
    assert taken == [], "a peer silent after Redis was healthy again is taken over"


class _CountingRedis:
    """The loop's Redis client, counting round trips: each command called on it, and each pipeline
    (sent as one round trip when executed); ``calls``: their names, in order."""

    def __init__(self, real: Any) -> None:
        self.real, self.round_trips, self.calls = real, 0, []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.real, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.round_trips += 1
            self.calls.append(name)
            return attr(*args, **kwargs)

        return counted


@pytest.mark.parametrize("peers", [2, 64])
def test_checking_every_peer_costs_the_same_round_trips_whatever_their_number(
    redis_url: str, run_id: str, peers: int
) -> None:
    """Issue 27 item 5: a consumer checks all its peers' heartbeats in one pipelined round, so W busy
    consumers cost W rounds a check interval, not W(W-1)."""
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(names.trajectories, "reward", id="0", mkstream=True)
    for i in range(peers):
        client.xadd(names.trajectories, encode_payload(make_trajectory(i)))
        client.xreadgroup("reward", f"peer{i}", {names.trajectories: ">"}, count=1)  # a consumer holding one entry
        client.sadd(names.instances, f"echo:peer{i}")
        client.set(names.heartbeat("echo", f"peer{i}"), b"x", px=60_000)  # alive

    async def main() -> int:
        bus = Bus(connect(redis_url))
        loop = _loop(bus, names)
        counting = _CountingRedis(bus.redis)
        loop.redis = counting  # type: ignore[assignment]
        await loop._reclaim_from_the_dead()
        await loop.drain()
        await bus.redis.aclose()
        return counting.round_trips

    try:
        round_trips = asyncio.run(main())
        assert len(_held_by(client, names, "alive")) == 0, "a live peer's entry was taken"
    finally:
        client.close()
    # the consumers (XINFO CONSUMERS), the instances (SMEMBERS), every heartbeat (one pipeline)
    assert round_trips == 3, f"{round_trips} round trips for {peers} peers"


def test_a_consumer_with_no_free_slot_looks_at_no_peer(redis_url: str, run_id: str) -> None:
    """A consumer that could take nothing (every in-flight slot held) leaves the dead-peer look to one with room:
    in a busy fleet most consumers are full, and W of them judging W - 1 peers a round cost Redis W(W - 1) heartbeat
    lookups. The dead peer's entry is still there for a consumer with room, which takes it."""
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    ids = _setup_dead_peer(client, names, entries=1)

    async def main() -> tuple[list[str], list[bytes]]:
        bus = Bus(connect(redis_url))
        loop = _loop(bus, names)
        counting = _CountingRedis(bus.redis)
        loop.redis = counting  # type: ignore[assignment]
        time.sleep(2 * INTERVAL_S)  # the dead peer's entry idle one heartbeat interval: claimable
        loop._reserved = loop.config.max_in_flight  # every slot held
        for _ in range(3):
            await loop._reclaim()
            await asyncio.sleep(INTERVAL_S)
        full = list(counting.calls)
        loop._reserved = 0  # room again: it looks, and takes the dead peer's entry
        for _ in range(3):
            await loop._reclaim()
            await asyncio.sleep(INTERVAL_S)
        taken = [row[0] for row in loop._held]
        await loop.drain()
        await bus.redis.aclose()
        return full, taken

    try:
        full, taken = asyncio.run(main())
    finally:
        client.close()
    # only the trim of what was consumed, never a look at the peers (XINFO CONSUMERS, SMEMBERS, the heartbeats)
    assert not {"xinfo_consumers", "smembers", "pipeline", "exists", "xpending_range"} & set(full), full
    assert [str(i) if isinstance(i, str) else i.decode() for i in taken] == [ids[0].decode()]
