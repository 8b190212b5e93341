"""Lanes that heal (:mod:`streamrl.coordinator.joining`, :mod:`streamrl.coordinator.mirror`), on two real
redis-servers: a lane batch whose manifest part was lost is joined without it and its lane told, and later indices
proceed; a lane whose Redis is down longer than the client rides out delays only that lane."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from test_coordinator_lanes import Pair, lane_manifest, ready, run_until

from streamrl.common.bus import Bus, connect
from streamrl.common.codec import decode, encode
from streamrl.common.config import ConsumerConfig
from streamrl.common.lanes import lane_of_key
from streamrl.common.messages import BATCH_SKIPPED, BatchManifest, DeadLetter
from streamrl.coordinator.batches import BatchBuilder
from streamrl.coordinator.dead_letters import LostBatch, what_was_lost
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.joining import Joiner, Lane
from streamrl.coordinator.mirror import Mirrored
from streamrl.coordinator.state import RunState
from streamrl.ops.redis_server import RedisServer


@pytest.fixture
def lane1_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "lane1-redis", appendonly=True, appendfsync="always").start()
    yield server
    server.stop()


@pytest.fixture
def pair(redis_url: str, lane1_server: RedisServer, run_id: str) -> Pair:
    return Pair(redis_url, lane1_server.url, run_id)


async def nothing(clients: list[aioredis.Redis]) -> None:
    pass


def record_dead(pair: Pair, k: int, lost: LostBatch) -> bool:
    """What lane ``k``'s coordinator does with the letter: count the batch dropped, delete its keys."""

    async def main() -> bool:
        client = connect(pair.urls[k])
        try:
            state = RunState(Bus(client), pair.names[k])
            groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
            builder = BatchBuilder(state, groups, prompts_per_step=1, max_staleness=0, drop_stale=True)
            return await builder.record_dead(lost.batch_id, lost.num_samples, lost.num_groups, "x", lost.buffers)
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_a_lane_batch_whose_manifest_part_is_lost_is_joined_without_it_and_later_indices_proceed(pair: Pair) -> None:
    lane1 = pair.sync[1]
    lost_batch = lane_manifest(pair.names[1], 0, ["p1", "p3"])

    async def scenario(clients: list[aioredis.Redis]) -> None:
        for ref in lost_batch.samples:  # the payloads the lost part named
            await clients[1].set(ref.key, b"payload")
        await pair.publish(clients, 1, lost_batch, part_bytes=1200)  # split: a part is lost below
        parts = sorted(k.decode() for k in lane1.keys("*manifest*"))
        assert len(parts) >= 2
        lane1.delete(parts[0])
        await pair.publish(clients, 0, lane_manifest(pair.names[0], 0, ["p0", "p2"]))
        await pair.publish(clients, 0, lane_manifest(pair.names[0], 1, ["p4"]))
        await pair.publish(clients, 1, lane_manifest(pair.names[1], 1, ["p5"]))

    key = b"the-run-key-0123456789"  # the lane's coordinator believes only a letter signed for the run
    run_until(pair, lambda: len(pair.home_batches()) >= 2 and bool(pair.letters(1)), scenario, key=key)
    run_until(pair, lambda: True, nothing, key=key)  # restarted: nothing joined or dead-lettered twice
    time.sleep(0.5)
    first, second = pair.home_batches()
    assert (first.index, second.index) == (0, 1)
    assert [s.group_id for s in first.samples[::2]] == ["p0", "p2"], "index 0 should be joined from lane 0 alone"
    assert [s.group_id for s in second.samples[::2]] == ["p4", "p5"] and {lane_of_key(s.key) for s in second.samples}
    assert not pair.letters(0)
    (letter,) = pair.letters(1)
    assert (
        f"batch-0 (4 samples) of lane 1: {BATCH_SKIPPED}" in letter.error and "manifest parts missing" in letter.error
    )
    lost = what_was_lost(letter, batches_stream=pair.names[1].batches, key=key, run_id=pair.home_names.run_id)
    assert isinstance(lost, LostBatch), lost
    assert (lost.batch_id, lost.num_samples, lost.num_groups) == ("batch-0", 4, 2)
    assert record_dead(pair, 1, lost)
    assert not lane1.keys(f"*{pair.names[1].batched_samples('batch-0', '')}*"), "lane 1's batch-0 left keys behind"
    assert lane1.get(pair.names[1].state("samples_dead")) == b"4"
    for k in (0, 1):
        assert pair.sync[k].xpending(pair.names[k].batches, "joiner")["pending"] == 0


def test_a_dead_batch_whose_manifest_part_is_gone_has_its_payloads_deleted(pair: Pair) -> None:
    """The learner's letter names a split batch's header; a part is gone: the payloads it named still go."""
    names = pair.names[1]
    batch = lane_manifest(names, 3, ["p1", "p3"])
    client = pair.sync[1]

    async def main() -> BatchManifest:
        c = connect(pair.urls[1])
        try:
            for ref in batch.samples:
                await c.set(ref.key, b"payload")
            await pair.publish([c, c], 1, batch, part_bytes=1200)
        finally:
            await c.aclose()
        (entry,) = [decode(f[b"d"], BatchManifest) for _, f in client.xrange(names.batches)]
        return entry

    header = asyncio.run(main())
    client.delete(header.parts[0])
    lost = LostBatch(header.id, header.num_samples, None, tuple(header.buffers))
    assert record_dead(pair, 1, lost)
    assert not client.keys(f"*{names.batched_samples('batch-3', '')}*"), "the lost part's payloads were kept"


def test_a_lane_redis_down_longer_than_the_client_rides_out_delays_only_that_lane(
    pair: Pair, lane1_server: RedisServer
) -> None:
    home = pair.sync[0]
    mirrored = Mirrored([-1, -1])
    letter = DeadLetter(
        stream=pair.home_names.weights,
        entry_id="1-0",
        group="l",
        consumer="l",
        error="bad weights",
        deliveries=1,
        payload=b"",
        ts=1.0,
    )

    async def main() -> None:
        clients = [connect(u, outage_s=1.0) for u in pair.urls]
        stop = asyncio.Event()
        lanes = [Lane(Bus(c), n) for c, n in zip(clients, pair.names, strict=True)]
        joiner = Joiner(
            Bus(clients[0]), pair.home_names, lanes, ConsumerConfig(), mirrored=mirrored, outage_retry_s=0.5
        )
        assert len(joiner.loops) == 2  # the heartbeat counts them
        task = asyncio.create_task(joiner.run(stop))

        async def until(what: str, done: object, timeout_s: float = 30.0) -> None:
            deadline = time.monotonic() + timeout_s
            while not done():  # type: ignore[operator]
                assert not task.done(), task.exception()
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.05)

        try:
            home.xadd(pair.home_names.weights, ready(0))
            await until("version 0 everywhere", lambda: mirrored.everywhere() == 0)
            lane1_server.stop()
            home.xadd(pair.home_names.weights, ready(1))
            home.xadd(pair.home_names.dead, {b"d": encode(letter)})  # not about a batch: to lane 0's dead
            await until("version 1 in lane 0", lambda: mirrored.versions[0] == 1)
            await until("the letter in lane 0", lambda: bool(pair.letters(0)))
            await asyncio.sleep(4.0)  # well past the client's 1 s of retries: the joiner goes on
            assert not task.done(), task.exception()
            assert mirrored.versions == [1, 0] and mirrored.everywhere() == 0
            lane1_server.start()
            await until("version 1 in lane 1 once it is back", lambda: mirrored.everywhere() == 1)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            for c in clients:
                await c.aclose()

    asyncio.run(main())
    assert [decode(f[b"d"]).version for _, f in pair.sync[1].xrange(pair.names[1].weights)] == [0, 1]  # type: ignore[attr-defined]
    (passed_on,) = pair.letters(0)
    assert passed_on.error == "bad weights"
