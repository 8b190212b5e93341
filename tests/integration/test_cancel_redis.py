"""Against a real redis-server: a heartbeat cancelled at any instant of a command still stops.

redis-py 8 sends every command through ``asyncio.wait_for`` (its default 5 s socket timeout); on
Python 3.11 a cancellation arriving as that write completes is dropped - here about every other
cancel - and with one plain ``task.cancel()`` the heartbeat loop, hence the service, never ended
(a CI hang).
"""

from __future__ import annotations

import asyncio
import random

from streamrl.common.aio import cancel_and_wait
from streamrl.common.bus import connect
from streamrl.common.health import heartbeat_forever
from streamrl.common.streams import StreamNames


def test_heartbeat_cancelled_at_random_instants_always_stops(redis_url: str, run_id: str) -> None:
    async def main() -> int:
        redis = connect(redis_url)
        names = StreamNames(run_id)
        rng = random.Random(0)
        try:
            for _ in range(40):
                beat = asyncio.create_task(heartbeat_forever(redis, names, "t", "i", 0.0005, lambda: {"status": "x"}))
                await asyncio.sleep(rng.random() * 0.003)
                await asyncio.wait_for(cancel_and_wait([beat], recancel_s=0.05), timeout=10)
                assert beat.done()
            return 40
        finally:
            await redis.aclose()

    assert asyncio.run(main()) == 40
