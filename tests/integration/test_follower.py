"""The stream follower (streamrl.common.follower) against a real Redis."""

from __future__ import annotations

import asyncio

from streamrl.common.bus import Bus, connect
from streamrl.common.codec import decode
from streamrl.common.follower import StreamFollower, previous_id, supervise
from streamrl.common.messages import WeightsPublished


def _event(version: int) -> WeightsPublished:
    return WeightsPublished(
        version=version, step=version, batch_id="", checksum="c", num_bytes=1, num_buckets=1, endpoint="tcp://learner:1"
    )


def test_entries_in_order_bad_ones_passed_over_and_a_cursor_to_read_again(redis_url: str, run_id: str) -> None:
    async def scenario() -> tuple[list[int], int]:
        bus = Bus(connect(redis_url))
        stream = f"{run_id}:followed"
        seen: list[int] = []
        retried = False

        async def handle(entries: list[tuple[str, WeightsPublished]], last_id: str) -> str:
            nonlocal retried
            for entry_id, event in entries:
                seen.append(event.version)
                if event.version == 2 and not retried:  # ask for version 2 again, once
                    retried = True
                    return previous_id(entry_id)
            return last_id

        follower = StreamFollower(
            bus.redis, stream, lambda f: decode(f.get(b"d", b""), WeightsPublished), handle, count=1, block_ms=50
        )
        stop = asyncio.Event()
        task = asyncio.create_task(follower.run("0-0", stop))
        await bus.publish(stream, _event(1))
        await bus.redis.xadd(stream, {"d": b"\x93 not a message"})
        await bus.redis.xadd(stream, {"other": b"field"})
        await bus.publish(stream, _event(2))
        await bus.publish(stream, _event(3))
        while len(seen) < 4:
            await asyncio.sleep(0.01)
        stop.set()
        await task
        await bus.redis.aclose()
        return seen, follower.skipped

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == ([1, 2, 2, 3], 2)


def test_a_follower_that_dies_is_reported() -> None:
    async def scenario() -> list[BaseException]:
        deaths: list[BaseException] = []

        async def broken() -> None:
            raise OSError("disk full")

        task = asyncio.create_task(broken())
        supervise(task, "the test follower", deaths.append)
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
        return deaths

    (error,) = asyncio.run(scenario())
    assert isinstance(error, OSError)
