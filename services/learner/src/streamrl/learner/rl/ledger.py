"""The learner's state in Redis, and every write it makes there: each one a :class:`~streamrl.common.tx.Tx`
(atomic, fenced by the learner's singleton lease, executed once however often the client re-sends it).

Keys (``names.state(...)``, the run's hash tag):

* ``learner`` (hash): ``published`` - the newest WeightsPublished (what a restart compares its
  checkpoint with); ``acked`` - every batch index below it is acknowledged (covered by a checkpoint).
* ``learner_version`` (string): ``{version}@{life}`` of the newest publication. A publication requires
  the value it last saw (compare-and-set), so a retried publication of one version never lands twice.
* ``learner_batches`` (hash): batch index -> :func:`~streamrl.learner.rl.batch_order.fingerprint` of
  what was consumed at it (``(lost)`` for a lost index); kept for the last :data:`KEEP_FINGERPRINTS`
  acknowledged indices, enough to recognise a copy.
* ``learner_failures:{batch id}`` (hash): ``started``, ``finished``, ``failed``, ``error`` of its steps;
  ``learner_dead:{batch id}``: its dead letter was written. Both go when the batch is acknowledged.

The write points (all here): :meth:`claim` and :meth:`lose` (an index's fingerprint), :meth:`start`
and :meth:`finish` (a step's attempt, before and after it; :meth:`note`: the error of one that ended
the learner group), :meth:`publish` (a version: the event
on ``weights`` + ``published`` + ``learner_version``), :meth:`dead_letter_once` (a dead letter on
``dead``, once per batch), :meth:`ack` (XACK of the covered entries + ``acked``, their batches'
failure keys, old fingerprints and sample payloads - the ``batched:{batch}:{trajectory id}`` keys of its
manifest - deleted, or given ``redis.payload_retention_s`` to live when that is set). The payloads are not in the
transaction (a batch's thousands of UNLINKs would hold Redis for tens of ms; in a run with lanes,
:mod:`streamrl.common.lanes`, a lane's are not even in the home's Redis): they are given ``redis.payload_orphan_ttl_s``
to live first (pipelined, one pipeline per client holding some, :func:`payload_deletes`), then the transaction runs
(fenced: a deposed learner stops there), then they are deleted (or given ``redis.payload_retention_s``), pipelined
again: plain commands that Redis serves between other clients' as it reads them. A learner that dies between the
steps leaves them to expire, never to leak, and one deposed before its transaction deletes nothing its successor may
still replay within that time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from streamrl.common import replies
from streamrl.common.bus import Bus, PreconditionFailed
from streamrl.common.codec import decode, encode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.lanes import LaneClients, lane_of_key
from streamrl.common.messages import BatchManifest, DeadLetter, TrainingBatch, WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.learner.rl.batch_order import LOST, Attempts, Batch

KEEP_FINGERPRINTS = 1024
"""Fingerprints kept below the acknowledged index (a copy arriving later than that is refused as unknown)."""


def payload_deletes(keys: Sequence[str], home: Any, lanes: LaneClients | None) -> list[tuple[Any, list[str]]]:
    """``keys`` grouped by the client holding them: ``home`` for the home's, a lane's client for a lane's (pure)."""
    at_home = [k for k in keys if lanes is None or lane_of_key(k) is None]
    in_lanes = [k for k in keys if lanes is not None and lane_of_key(k) is not None]
    groups = [(home, at_home)] if at_home else []
    return groups + (lanes.by_client(in_lanes) if lanes is not None and in_lanes else [])


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class LearnerLedger:
    """Reads and writes of the learner's Redis state (see the module docstring)."""

    def __init__(self, bus: Bus, names: StreamNames, group: str = "learner") -> None:
        self.bus = bus
        self.names = names
        self.group = group
        self.learner = names.state("learner")
        self.version_key = names.state("learner_version")
        self.fingerprints = names.state("learner_batches")

    def _failures(self, batch_id: str) -> str:
        return self.names.state(f"learner_failures:{batch_id}")

    def _dead(self, batch_id: str) -> str:
        return self.names.state(f"learner_dead:{batch_id}")

    # ---------------------------------------------------------------- reads
    async def published(self) -> WeightsPublished | None:
        value = await self.bus.redis.hget(self.learner, "published")
        return decode(replies.raw(value), WeightsPublished) if value else None

    async def version_mark(self) -> str | None:
        return _text(await self.bus.redis.get(self.version_key))

    async def acked_index(self) -> int:
        return int(await self.bus.redis.hget(self.learner, "acked") or 0)

    async def record(self, index: int) -> str | None:
        """The fingerprint of what was consumed at ``index``, None if none is kept."""
        return _text(await self.bus.redis.hget(self.fingerprints, str(index)))

    async def attempts(self, batch_id: str) -> Attempts:
        raw = {
            replies.text(k): replies.raw(v) for k, v in (await self.bus.redis.hgetall(self._failures(batch_id))).items()
        }
        return Attempts(
            started=int(raw.get("started", 0)),
            finished=int(raw.get("finished", 0)),
            failed=int(raw.get("failed", 0)),
            error=raw.get("error", b"").decode(errors="replace"),
        )

    async def coordinator_index(self) -> int:
        """The coordinator's ``state:batch_index``: every batch index below it was published (the one key of
        the coordinator's state the learner reads, to tell a lost index from one still to be written)."""
        raw = await self.bus.redis.get(self.names.state("batch_index"))
        return int(raw) if raw is not None else 0

    async def still_to_come(self, stream: str) -> dict[int, str]:
        """Batch index -> entry id of the entries the learner will still be handed: pending for its group,
        or after the group's last delivered entry. Undecodable entries are left out (they are dead-lettered)."""
        groups = [g for g in await self.bus.redis.xinfo_groups(stream) if _text(g["name"]) == self.group]
        last = _text(groups[0]["last-delivered-id"]) if groups else "0-0"
        entries: list[replies.Entry] = []
        start = "-"
        while held := replies.pending(
            await self.bus.redis.xpending_range(stream, self.group, min=start, max="+", count=256)
        ):
            for row in held:
                entries += replies.entries(await self.bus.redis.xrange(stream, row.entry_id, row.entry_id))
            start = "(" + held[-1].entry_id
            if len(held) < 256:
                break
        entries += replies.entries(await self.bus.redis.xrange(stream, f"({last}", "+"))
        found: dict[int, str] = {}
        for entry_id, fields in entries:
            try:
                batch: Batch = decode(fields.get(b"d", b""), (TrainingBatch, BatchManifest))
            except PoisonMessageError:
                continue
            found.setdefault(batch.index, entry_id.decode())
        return found

    async def entry(self, stream: str, entry_id: str) -> Batch | None:
        """The batch of one entry, None when it is gone (acknowledged and trimmed) or undecodable."""
        found = replies.entries(await self.bus.redis.xrange(stream, entry_id, entry_id))
        if not found:
            return None
        try:
            return decode(found[0][1].get(b"d", b""), (TrainingBatch, BatchManifest))
        except PoisonMessageError:
            return None

    # --------------------------------------------------------------- writes
    async def claim(self, index: int, fingerprint: str) -> None:
        """Record what is consumed at ``index`` (the same value again is a no-op)."""
        await self.bus.tx().hset(self.fingerprints, str(index), fingerprint).execute()

    async def lose(self, index: int) -> None:
        await self.claim(index, LOST)

    async def start(self, batch_id: str) -> None:
        """Count a step of ``batch_id`` as started: before it runs, so a step that kills the process counts."""
        await self.bus.tx().hincrby(self._failures(batch_id), "started", 1).execute()

    async def finish(self, batch_id: str, error: str | None) -> None:
        """Count a step of ``batch_id`` as returned (``error``: it raised)."""
        tx = self.bus.tx().hincrby(self._failures(batch_id), "finished", 1)
        if error is not None:
            tx.hincrby(self._failures(batch_id), "failed", 1).hset(self._failures(batch_id), "error", error[:500])
        await tx.execute()

    async def note(self, batch_id: str, error: str) -> None:
        """Keep ``error`` as what ended a step of ``batch_id`` that is not counted as returned: a failure on
        one rank of a group, which may be the symptom of another rank's death (the step counts as a kill)."""
        await self.bus.tx().hset(self._failures(batch_id), "error", error[:500]).execute()

    async def publish(self, event: WeightsPublished, seen: str | None, mark: str) -> bool:
        """Publish ``event`` unless the version mark moved from ``seen``: True if written now, False when
        this publication (``mark``) was written before (a retry after an unknown outcome)."""
        tx = self.bus.tx().require(self.version_key, equals=seen)
        tx.xadd(self.names.weights, event).hset(self.learner, "published", encode(event)).set(self.version_key, mark)
        try:
            await tx.execute()
        except PreconditionFailed as e:
            if _text(e.found) == mark:
                return False
            raise RuntimeError(
                f"version {event.version}: the learner's publication mark is {_text(e.found)!r}, not {seen!r}: "
                "another learner published meanwhile"
            ) from e
        return True

    async def dead_letter_once(self, batch_id: str, letter: DeadLetter) -> bool:
        """Write ``letter`` for ``batch_id`` unless one was written before (a replay); True if written now."""
        tx = self.bus.tx().require(self._dead(batch_id), equals=None)
        tx.set(self._dead(batch_id), 1).xadd(self.names.dead, letter)
        try:
            await tx.execute()
        except PreconditionFailed:
            return False
        return True

    async def ack(
        self,
        stream: str,
        entries: list[str],
        batch_ids: list[str],
        acked_from: int,
        acked_index: int,
        payloads: Sequence[str] = (),
        lanes: LaneClients | None = None,
    ) -> None:
        """Acknowledge ``entries`` (all covered by a checkpoint: indices below ``acked_index``) and forget what the
        learner kept about their batches, with ``payloads`` (the hashes their manifests' samples were read from);
        ``acked`` moves from ``acked_from`` to ``acked_index``. (The entries themselves go with the consumer
        loop's trimming by consumption, after ``redis.retain_consumed_s``.) ``lanes``: where a lane's payloads are
        (see the module docstring)."""
        retention_s = math.ceil(self.bus.payload_retention_s)
        held = payload_deletes(payloads, self.bus.redis, lanes)
        grace_s = max(1, math.ceil(self.bus.payload_orphan_ttl_s))
        await _on_clients(held, lambda pipe, key: pipe.expire(key, grace_s))  # expire even if this ack stops here
        tx = self.bus.tx().xack(stream, self.group, *entries)
        tx.hset(self.learner, "acked", acked_index)
        for batch_id in batch_ids:
            tx.delete(self._failures(batch_id), self._dead(batch_id))
        old = range(max(0, acked_from - KEEP_FINGERPRINTS), max(0, acked_index - KEEP_FINGERPRINTS))
        if old:
            tx.hdel(self.fingerprints, *(str(i) for i in old))
        await tx.execute()
        if retention_s > 0:
            await _on_clients(held, lambda pipe, key: pipe.expire(key, retention_s))
        else:
            await _on_clients(held, lambda pipe, key: pipe.unlink(key))


async def _on_clients(groups: list[tuple[Any, list[str]]], command: Callable[[Any, str], Any]) -> None:
    """``command`` on each key of ``groups`` (client, keys), one pipeline per client."""
    for client, keys in groups:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            command(pipe, key)
        await pipe.execute()
