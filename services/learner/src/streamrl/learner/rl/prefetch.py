"""The next batch's payloads read while the current one trains: the learner's fetch off its step's path.

While batch ``k`` trains (in a thread), :class:`Prefetcher` watches the ``batches`` stream for the entry right
after ``k``'s (``XREAD BLOCK`` from ``k``'s id, COUNT 1: it waits for the entry to be written, not a poll; no
consumer-group read: the consumer loop still delivers it, counts its deliveries and acks it as ever); when that entry is a :class:`BatchManifest` at index ``k + 1`` it
reads its parts and payloads (:func:`~streamrl.common.batch_payloads.fetch_batch`: bounded replies) in the
background. When the consumer loop delivers that very entry (same entry id, same batch id) the handler takes
the result (:meth:`Prefetcher.take`) after its order and duplicate checks, instead of reading Redis then; any
other delivery discards it. So:

* at most one batch is prefetched (one task; the next starts only once it was taken or discarded);
* nothing is trained that the handler would not have trained: the order check, the duplicate check and the
  attempt count run on the delivered entry as before; a copy of a consumed batch (index below ``k + 1``) is
  never prefetched;
* a payload or part missing (:class:`~streamrl.common.batch_payloads.MissingPayloadError`) or poison found by
  the prefetch is raised by :meth:`take`, exactly as the handler's own read would raise it (the batch is
  skipped, dead-lettered, never trained short); any other failure of the prefetch (Redis down, a lost reply)
  is logged and the handler reads the batch itself.

The stream is read on the home's client; the parts and payloads on the client of each key's lane
(:attr:`Prefetcher.clients`, a :class:`~streamrl.common.lanes.LaneClients`: the home alone without lanes).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from streamrl.common.batch_payloads import MissingPayloadError, fetch_batch, load_manifest
from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.lanes import LaneClients
from streamrl.common.messages import BatchManifest, TrainingBatch
from streamrl.common.replies import Entry, read_entries

logger = logging.getLogger(__name__)

WAIT_MS = 2000
"""How long one look for the next entry waits for it to be written (``XREAD BLOCK``): the entry is seen the
moment it lands, and an idle learner asks Redis once per this (not a poll every few milliseconds)."""

Fetched = tuple[BatchManifest, TrainingBatch]
"""A manifest read whole (parts included) and the batch its payloads make."""


@dataclass
class _Pending:
    after: str
    """The entry whose successor is wanted."""
    index: int
    """The index it must have."""
    entry_id: str = ""
    """The successor's entry id, once found."""
    batch_id: str = ""
    task: asyncio.Task[Fetched | None] | None = None


class Prefetcher:
    """Reads the batch after the one training now (see the module docstring)."""

    def __init__(self, redis: Any, stream: str, *, max_reply_bytes: int) -> None:
        self.redis = redis
        self.clients = LaneClients(redis, [])
        """Where the parts and payloads are read (the learner sets its lanes' once connected)."""
        self.stream = stream
        self.max_reply_bytes = max_reply_bytes
        self._pending: _Pending | None = None

    def start(self, after: str, index: int) -> None:
        """Prefetch the entry after ``after`` if it is the manifest of batch ``index`` (no-op while one is held,
        or without an entry id)."""
        if self._pending is not None or not after:
            return
        pending = _Pending(after, index)
        pending.task = asyncio.create_task(self._fetch(pending), name=f"prefetch-{index}")
        pending.task.add_done_callback(_retrieve)
        self._pending = pending

    async def _fetch(self, pending: _Pending) -> Fetched | None:
        found: list[Entry] = []
        while not found:  # the first entry after ``after``, as soon as it is written
            found = read_entries(await self.redis.xread({self.stream: pending.after}, count=1, block=WAIT_MS))
        ((entry_id, fields),) = found
        pending.entry_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        try:
            entry: TrainingBatch | BatchManifest = decode(fields.get(b"d", b""), (TrainingBatch, BatchManifest))
        except PoisonMessageError:
            return None  # the consumer loop dead-letters it
        if not isinstance(entry, BatchManifest) or entry.index != pending.index:
            return None
        pending.batch_id = entry.id
        whole = await load_manifest(self.clients, entry, max_reply_bytes=self.max_reply_bytes)
        return whole, await fetch_batch(self.clients, whole, max_reply_bytes=self.max_reply_bytes)

    async def take(self, entry_id: str, manifest: BatchManifest) -> Fetched | None:
        """The prefetched batch if it is ``manifest`` at ``entry_id`` (waiting for its reads to end), else None
        (nothing held, or something else held: discarded). Raises what the reads raised when that is a
        MissingPayloadError or PoisonMessageError."""
        pending, self._pending = self._pending, None
        if pending is None or pending.task is None:
            return None
        if (pending.entry_id, pending.batch_id) != (entry_id, manifest.id):
            pending.task.cancel()
            return None
        try:
            return await pending.task
        except (MissingPayloadError, PoisonMessageError):
            raise
        except Exception as e:  # noqa: BLE001 - a failed prefetch is read again by the handler
            logger.warning("prefetching %s failed (%s: %s): reading it now", manifest.id, type(e).__name__, e)
            return None

    def close(self) -> None:
        """Stop a prefetch in progress (its result, if any, is dropped)."""
        if self._pending is not None and self._pending.task is not None:
            self._pending.task.cancel()
        self._pending = None


def _retrieve(task: asyncio.Task[Fetched | None]) -> None:
    """Mark a prefetch's failure seen (it is raised again by :meth:`Prefetcher.take`, or the prefetch discarded)."""
    if not task.cancelled():
        task.exception()
