"""A multi-turn episode (turns, stop reason, loss mask, per-turn rewards) survives a real Redis stream, inside a
Trajectory, a ScoredTrajectory and a TrainingBatch."""

from __future__ import annotations

import asyncio

from multiturn_samples import batch, episode, scored

from streamrl.common.bus import PAYLOAD_FIELD, Bus, connect
from streamrl.common.codec import decode
from streamrl.common.messages import Message
from streamrl.common.streams import StreamNames


def test_round_trip_through_redis_streams(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)

    async def main() -> list[Message]:
        client = connect(redis_url)
        try:
            bus = Bus(client)
            sent = [(names.trajectories, episode()), (names.scored, scored()), (names.batches, batch())]
            for stream, message in sent:
                await bus.publish(stream, message)
            out = []
            for stream, _ in sent:
                ((_, fields),) = await client.xrange(stream)
                out.append(decode(fields[PAYLOAD_FIELD]))
            return out
        finally:
            await client.aclose()

    assert asyncio.run(main()) == [episode(), scored(), batch()]
