"""The stream follower, written once: every reader of a broadcast stream sees every entry, in order.

Consumer groups (:mod:`streamrl.common.consumer`) share a stream's work among instances; a follower
instead reads a stream on its own from a cursor: the ``weights`` events every rollout worker and
the coordinator act on, the ``dead`` letters the coordinator accounts for. What a follower must
get right, and two hand-written copies once got differently:

* an entry that cannot be decoded, or that its reader refuses (``decode_entry`` raises
  :class:`PoisonMessageError`, e.g. a weights event signed with another key), is logged once with
  its id and reason and passed over - it never stops the follower;
* entries are handed over in order, a read's worth at a time; the handler returns the cursor to read
  on from (normally the last entry's id; an earlier one to read an entry again, e.g. a weight
  update to retry), and may persist it;
* Redis outages are ridden out by the client (:class:`streamrl.common.bus.OutageRetry`); any other
  exception ends the follower - its owner supervises it (:func:`supervise`), since a service
  whose follower died must not keep a healthy heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import redis.asyncio as aioredis

from streamrl.common.errors import PoisonMessageError
from streamrl.common.replies import read_entries

logger = logging.getLogger(__name__)
T = TypeVar("T")


class StreamFollower(Generic[T]):
    """Follow ``stream`` from ``cursor``: ``handle(entries, last_id)`` gets each read's decoded entries.

    Example:
        follower = StreamFollower(redis, names.weights, decode_weights, on_weights)
        await follower.run(cursor="0-0", stop=stop)
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str,
        decode_entry: Callable[[dict[bytes, bytes]], T],
        handle: Callable[[list[tuple[str, T]], str], Awaitable[str]],
        *,
        count: int = 64,
        block_ms: int = 1000,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.decode_entry = decode_entry
        self.handle = handle
        self.count = count
        self.block_ms = block_ms
        self.skipped = 0
        """Entries passed over as undecodable or refused."""

    async def run(self, cursor: str, stop: asyncio.Event | None = None) -> None:
        """Follow until ``stop`` is set (or forever, until cancelled)."""
        while stop is None or not stop.is_set():
            got = read_entries(await self.redis.xread({self.stream: cursor}, count=self.count, block=self.block_ms))
            if not got:
                continue
            entries: list[tuple[str, T]] = []
            for entry_id, fields in got:
                text_id = entry_id.decode()
                try:
                    entries.append((text_id, self.decode_entry(fields)))
                except PoisonMessageError as e:
                    self.skipped += 1
                    logger.error("skipping %s entry %s: %s", self.stream.rsplit(":", 1)[-1], text_id, e)
            cursor = await self.handle(entries, got[-1][0].decode())


def supervise(task: asyncio.Task[None], what: str, on_death: Callable[[BaseException], None]) -> None:
    """Call ``on_death(error)`` (with one ERROR line) if ``task`` ends with an exception."""

    def done(t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            error = t.exception()
            assert error is not None
            logger.error("%s died: %s: %s", what, type(error).__name__, error)
            on_death(error)

    task.add_done_callback(done)


def previous_id(entry_id: str) -> str:
    """The stream id just before ``entry_id`` (a cursor that reads that entry again)."""
    ms, seq = (int(x) for x in entry_id.split("-"))
    return f"{ms}-{seq - 1}" if seq > 0 else f"{ms - 1}-18446744073709551615"
