"""The weights mirror of a run with lanes: every home ``weights`` entry copied into every lane's, once each.

Lane 0's joiner (:mod:`streamrl.coordinator.joining`) runs one mirror per lane, side by side: each follows the
home ``weights`` from its lane's mark (``state:weights_mirrored``, the last home entry id copied) and copies
each entry, as it is (signed for the run), in one lane transaction that XADDs it and sets the mark on the
precondition that the mark is still the one read: a restart or a second joiner never mirrors an entry twice.
A lane whose Redis is down delays only its own mirror (the joiner retries it until the lane answers); the
others keep following the one policy version.

:class:`Mirrored` holds the newest version each lane has: lane 0's coordinator, which ends the run, ends it
only once every lane has the last version (a lane back from an outage then gets it and ends too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from streamrl.common.bus import PAYLOAD_FIELD, Bus
from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.follower import StreamFollower
from streamrl.common.messages import Message, WeightsPublished
from streamrl.common.replies import entries, text
from streamrl.common.streams import StreamNames
from streamrl.common.trim import parse_id
from streamrl.common.tx import PreconditionFailed

MIRRORED = "weights_mirrored"
"""Lane state: the last home ``weights`` entry mirrored into the lane."""
BLOCK_MS = 200
LOOK_BACK = 16
"""At start, the newest entries of a lane's ``weights`` read for the version it holds (one undecodable entry
there must not hide it)."""


@dataclass(frozen=True)
class Lane:
    """One lane as the joiner sees it: its bus (its Redis) and its names."""

    bus: Bus
    names: StreamNames


@dataclass
class Mirrored:
    """The newest weights version mirrored into each lane (-1: none seen yet)."""

    versions: list[int] = field(default_factory=list)

    def everywhere(self) -> int:
        """The newest version every lane has (-1: some lane has none yet)."""
        return min(self.versions, default=-1)

    def saw(self, lane: int, payload: bytes) -> None:
        """Lane ``lane`` holds the weights entry ``payload`` (an undecodable one moves nothing)."""
        try:
            msg: Message = decode(payload)
        except PoisonMessageError:
            return
        if isinstance(msg, WeightsPublished):
            self.versions[lane] = max(self.versions[lane], msg.version)


def after(entry_id: str, mark: str) -> bool:
    """Entry ``entry_id`` comes after ``mark`` ("" = before everything)."""
    return not mark or parse_id(entry_id) > parse_id(mark)


async def mirror_lane(
    home: Bus, home_names: StreamNames, lanes: Sequence[Lane], k: int, mirrored: Mirrored, stop: asyncio.Event
) -> None:
    """Copy every home ``weights`` entry into lane ``k``'s, once each, until ``stop``."""
    lane = lanes[k]
    for _, fields in entries(await lane.bus.redis.xrevrange(lane.names.weights, count=LOOK_BACK)):  # what it holds
        mirrored.saw(k, fields.get(PAYLOAD_FIELD, b""))
    mark = text(await lane.bus.redis.get(lane.names.state(MIRRORED)) or b"")

    async def each(read: list[tuple[str, bytes]], last_id: str) -> str:
        nonlocal mark
        for entry_id, payload in read:
            mark = await mirror_one(lane, mark, entry_id, payload)
            mirrored.saw(k, payload)
        return last_id

    def raw(fields: dict[bytes, bytes]) -> bytes:
        return fields.get(PAYLOAD_FIELD, b"")

    follower = StreamFollower(home.redis, home_names.weights, raw, each, block_ms=BLOCK_MS)
    await follower.run(mark or "0-0", stop)


async def mirror_one(lane: Lane, mark: str, entry_id: str, payload: bytes) -> str:
    """Mirror one entry into ``lane`` unless its mark is past it; the lane's mark after."""
    key = lane.names.state(MIRRORED)
    while after(entry_id, mark):
        tx = lane.bus.tx().require(key, equals=mark or None)
        tx.xadd_raw(lane.names.weights, payload).set(key, entry_id)
        try:
            await tx.execute()
            return entry_id
        except PreconditionFailed:
            mark = text(await lane.bus.redis.get(key) or b"")
    return mark
