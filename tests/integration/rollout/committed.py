"""What a rollout worker committed, read back as the reward tier and the learner see it: since payload-once
the worker's outputs (and its ``trajectories`` stream) hold :class:`TrajectoryRecord`s, each naming the
payload key of its :class:`Trajectory`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from streamrl.common.bus import PAYLOAD_FIELD, Output
from streamrl.common.codec import decode
from streamrl.common.messages import Trajectory, TrajectoryRecord
from streamrl.common.payload_format import unpack_payload
from streamrl.common.streams import StreamNames


async def payloads_of(redis: Any, records: Sequence[TrajectoryRecord]) -> list[Trajectory]:
    """Each record's payload, decoded (a missing payload fails the test, naming its key)."""
    out = []
    for record in records:
        data = await redis.get(record.payload_key)
        assert data is not None, f"payload {record.payload_key} of {record.id} is not in Redis"
        out.append(unpack_payload(data))
    return out


async def handled(redis: Any, outputs: Sequence[Output]) -> list[Trajectory]:
    """The trajectories of ``RolloutService.handle``'s outputs (its records; the PERSISTs are left out)."""
    return await payloads_of(redis, [o.message for o in outputs if isinstance(o.message, TrajectoryRecord)])


async def on_stream(redis: Any, names: StreamNames) -> list[Trajectory]:
    """Every trajectory committed on the run's ``trajectories`` stream so far, in order."""
    entries = await redis.xrange(names.trajectories)
    return await payloads_of(redis, [decode(fields[PAYLOAD_FIELD], TrajectoryRecord) for _, fields in entries])


async def wait_on_stream(redis: Any, names: StreamNames, count: int, timeout_s: float) -> list[Trajectory]:
    """The trajectories committed, once there are ``count`` (or those there are after ``timeout_s``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while await redis.xlen(names.trajectories) < count and loop.time() <= deadline:
        await asyncio.sleep(0.02)
    return await on_stream(redis, names)
