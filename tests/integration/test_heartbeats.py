"""Against a real redis-server: heartbeats are found through the instance set, never by a SCAN.

A run's keyspace is large (once held one de-duplication key per handled message, hundreds of
thousands in a demo run); `streamrl up` showed the live instances every 2 s by SCANning that whole
keyspace, which cost more CPU per step than the reward service.
"""

from __future__ import annotations

import asyncio
import time

import redis as syncredis

from streamrl.common.aio import cancel_and_wait
from streamrl.common.bus import connect
from streamrl.common.health import heartbeat_forever, live_heartbeats
from streamrl.common.streams import StreamNames


def test_live_heartbeats_follow_the_instances_and_leave_out_the_expired(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    client = syncredis.Redis.from_url(redis_url)
    client.mset({names.state(f"m{i}"): b"1" for i in range(5000)})  # the keyspace of a busy run

    async def beat_briefly() -> None:
        redis = connect(redis_url)
        tasks = [
            asyncio.create_task(heartbeat_forever(redis, names, svc, inst, 0.2, lambda: {"status": "ok"}))
            for svc, inst in [("rollout", "r-0"), ("rollout", "r-1"), ("reward", "w:0")]
        ]
        await asyncio.sleep(0.1)
        await cancel_and_wait(tasks)
        await redis.aclose()

    asyncio.run(beat_briefly())
    beats = live_heartbeats(client, names)
    assert [(b.service, b.instance) for b in beats] == [("reward", "w:0"), ("rollout", "r-0"), ("rollout", "r-1")]
    assert [b.instance for b in live_heartbeats(client, names, "rollout")] == ["r-0", "r-1"]
    assert live_heartbeats(client, names, "learner") == []

    time.sleep(0.5)  # TTL 2 x 0.2 s: every key has expired
    assert live_heartbeats(client, names) == []
    # still members: a consumer judges a dead instance's pending entries by it, then removes it
    assert client.scard(names.instances) == 3
    client.close()
