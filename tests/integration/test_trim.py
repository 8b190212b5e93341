"""Streams trimmed by consumption, against a real redis-server: after a burst is consumed the stream
holds (to within one macro node, ``XTRIM MINID ~``) only what some group still needs; a pending or
unread entry is never trimmed; ``redis.retain_consumed_s`` keeps recent consumed entries."""

from __future__ import annotations

import asyncio

import redis
from test_bus import make_trajectory

from streamrl.common.bus import Bus, Output, connect
from streamrl.common.config import ConsumerConfig
from streamrl.common.consumer import ConsumerLoop, encode_payload
from streamrl.common.messages import Trajectory
from streamrl.common.streams import StreamNames

NODE = 100
"""Entries per stream macro node (redis' stream-node-max-entries default): what ``~`` may leave."""


async def _nothing(_: Trajectory) -> list[Output]:
    return []


def _consume(url: str, names: StreamNames, retain_s: float = 0.0) -> None:
    """Consume the stream in burst mode as group ``reward``, then run one reclaim round (it trims)."""

    async def main() -> None:
        bus = Bus(connect(url), retain_consumed_s=retain_s)
        loop: ConsumerLoop[Trajectory] = ConsumerLoop(
            bus,
            names,
            stream=names.trajectories,
            group="reward",
            consumer="c",
            handler=_nothing,
            message_type=Trajectory,
            config=ConsumerConfig(claim_interval_s=0.05),
        )
        await loop.run(asyncio.Event(), burst=True)
        await loop._reclaim()
        await bus.redis.aclose()

    asyncio.run(main())


def _fill(client: redis.Redis, names: StreamNames, count: int) -> list[bytes]:
    return [client.xadd(names.trajectories, encode_payload(make_trajectory(i))) for i in range(count)]


def test_a_consumed_burst_is_trimmed_and_what_is_pending_or_unread_stays(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(names.trajectories, "reward", id="0", mkstream=True)
    client.xgroup_create(names.trajectories, "audit", id="0")  # a second group, behind
    ids = _fill(client, names, 1000)
    held = client.xreadgroup("audit", "slow", {names.trajectories: ">"}, count=450)  # read, never acked
    client.xack(names.trajectories, "audit", *[i for i, _ in held[0][1][:300]])  # the first 300 handled
    _consume(redis_url, names)
    left = [i for i, _ in client.xrange(names.trajectories)]
    assert set(ids[300:]) <= set(left), "a pending or unread entry of 'audit' was trimmed"
    assert len(left) <= 700 + NODE, f"{len(left)} entries left: consumed ones not trimmed"
    client.xack(names.trajectories, "audit", *[i for i, _ in held[0][1][300:]])
    client.xreadgroup("audit", "slow", {names.trajectories: ">"})  # the rest read ...
    client.xack(names.trajectories, "audit", *ids[450:])  # ... and handled: nothing is needed any more
    _consume(redis_url, names)
    assert client.xlen(names.trajectories) <= NODE
    assert client.xpending(names.trajectories, "reward")["pending"] == 0


def test_retain_consumed_s_keeps_recent_consumed_entries(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    _fill(client, names, 500)
    _consume(redis_url, names, retain_s=600)
    assert client.xlen(names.trajectories) == 500


def test_a_stream_without_groups_is_not_trimmed(redis_url: str, run_id: str) -> None:
    from streamrl.common.trim import trim_consumed

    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    _fill(client, names, 300)

    async def main() -> int:
        bus = Bus(connect(redis_url))
        removed = await trim_consumed(bus.redis, names.trajectories, 0.0)
        await bus.redis.aclose()
        return removed

    assert asyncio.run(main()) == 0 and client.xlen(names.trajectories) == 300


def test_one_round_trims_more_than_ten_thousand_consumed_entries(redis_url: str, run_id: str) -> None:
    """XTRIM's approximate form stops at ~10,000 entries a call unless told otherwise: a stream taking
    more than that per trimming round would grow (before: 29,999 consumed entries, 9,980 removed)."""
    from streamrl.common.trim import trim_consumed

    stream = StreamNames(run_id).trajectories

    async def main() -> tuple[int, int]:
        client = connect(redis_url)
        try:
            pipe = client.pipeline(transaction=False)
            for _ in range(30_000):
                pipe.xadd(stream, {b"d": b"x"})
            await pipe.execute()
            await client.xgroup_create(stream, "reward", id="0")
            delivered = await client.xreadgroup("reward", "c", {stream: ">"}, count=30_000)
            await client.xack(stream, "reward", *[entry_id for entry_id, _ in delivered[0][1]])
            await client.xadd(stream, {b"d": b"unread"})
            removed = await trim_consumed(client, stream, 0.0)
            return removed, int(await client.xlen(stream))
        finally:
            await client.aclose()

    removed, left = asyncio.run(main())
    assert removed >= 30_000 - NODE and left <= NODE + 1
