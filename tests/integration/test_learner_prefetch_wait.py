"""The learner's prefetch waits for the next batch entry with a blocking read: it sees the entry the moment it
is written, and while none comes it asks Redis about once per ``WAIT_MS`` instead of every 50 ms. Real
redis-server (its command counters)."""

from __future__ import annotations

import asyncio
import time

import redis as syncredis

from streamrl.common.bus import connect
from streamrl.common.streams import StreamNames
from streamrl.learner.rl import prefetch
from streamrl.learner.rl.prefetch import Prefetcher


def stream_looks(client: syncredis.Redis) -> int:  # type: ignore[type-arg]
    """XRANGE and XREAD calls the server ran since its counters were reset."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("xrange", "xread"))


def test_the_prefetch_waits_for_the_next_entry_without_polling(redis_url: str, run_id: str) -> None:
    stream = StreamNames(run_id).batches
    admin = syncredis.Redis.from_url(redis_url)
    first = admin.xadd(stream, {b"d": b"batch k"}).decode()

    async def scenario() -> tuple[int, float]:
        redis = connect(redis_url)
        prefetcher = Prefetcher(redis, stream, max_reply_bytes=2**20)
        admin.config_resetstat()
        prefetcher.start(first, index=1)
        await asyncio.sleep(1.5)  # the next batch is not there yet: the learner trains batch k meanwhile
        looks = stream_looks(admin)
        assert prefetcher._pending is not None and prefetcher._pending.task is not None
        task = prefetcher._pending.task
        written = time.monotonic()
        admin.xadd(stream, {b"d": b"\xc1 not a batch"})  # seen at once (then left to the consumer loop: poison)
        assert await asyncio.wait_for(task, 5) is None
        seen_after_s = time.monotonic() - written
        prefetcher.close()
        await redis.aclose()
        return looks, seen_after_s

    looks, seen_after_s = asyncio.run(scenario())
    assert prefetch.WAIT_MS >= 1000
    assert looks <= 2, f"{looks} reads of the stream in 1.5 s: a poll"  # polled every 50 ms: ~30
    assert seen_after_s < 1.0, f"the entry was seen {seen_after_s:.2f} s after it was written"
