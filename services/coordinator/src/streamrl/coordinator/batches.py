"""The batch builder: ready groups become training batches on the ``batches`` stream, and batches
the learner gave up on are accounted for.

Which groups go into batch ``k`` is the pure rule of ``batching.py``. Here it meets Redis: groups over
the staleness bound are dropped (their replacements owed the version batch ``k`` needs), batch ``k`` waits
- at most ``wait_s`` (``coordinator.batch_wait_s``) - while a group whose last batch it is is still in flight
or owed (:meth:`GroupBuffer.coming_versions`, read only when some group of it could go later), and batch
``k`` (id ``batch-{k}``, from its index) is published - as a BatchManifest carrying each sample's scored
record and naming where its payload lies, never the payloads - in the same transaction that removes its
groups from ``ready`` (renaming each payload to ``batched:{batch}:{trajectory id}`` and deleting the
buffers, :meth:`GroupBuffer.queue_batched`), drops too-stale groups with their payloads, and sets
``batch_index`` to ``k + 1`` - on the precondition that ``batch_index`` is
still ``k`` (compare-and-set). A re-send of that transaction after a lost reply runs it once
(:mod:`streamrl.common.tx`), and a builder whose view is out of date (a restarted or deposed
coordinator, which the lease fence stops anyway) finds the index taken, writes nothing and reads the
state again: the ``batches`` stream never holds an index twice nor skips one.

A batch the learner consumed without training it (it failed ``max_deliveries`` times) reaches the
``dead`` stream as a DeadLetter holding the batch's manifest (a missing payload makes one such: the
learner never trains a batch short). The learner still publishes a version for it (version = batches
consumed), so admission goes on; here its groups are counted dropped once per batch id
(``batches_dead``, ``samples_dead``, ``batch_groups_dead``) with one error line naming the reason -
they are not in flight any more and are never failed or replaced - and their payloads
(``batched:{batch}:{trajectory id}``, only those named under the batch's own id) are deleted in the same script. A trained batch's samples are deleted by the
learner, when a checkpoint covers it.

A batch the learner refused *without consuming it* (it arrived out of order, or conflicts with what
the learner holds at its index) gets no version: in synchronous mode admission would stay closed for
ever, waiting for a version that needs that very index consumed. It is sent again, whole, at its
index (:meth:`BatchBuilder.resend`: the same manifest, whose samples are still kept; the learner takes a copy of a batch it already consumed as a
duplicate), at most ``consumer.max_deliveries - 1`` times; refused once more, its groups are counted
dropped as above.

A batch whose manifest would be large (its refs over :data:`~streamrl.common.messages.MANIFEST_PART_BYTES`,
about 1,000 samples of 1 KB records) is published split (:class:`~streamrl.common.messages.ManifestPart`): its
parts are SET first - plain pipelined commands of at most ``redis.max_command_mb``, under keys of this attempt's
own random token, with ``redis.payload_orphan_ttl_s`` to live - then the batch's transaction PERSISTs them
and XADDs the header naming them. So no entry and no command grows with the batch (18,000 samples: a header
of a few tens of KB, parts of 1 MiB), the batch stays one atomic transaction, and an attempt that crashed or
lost the compare-and-set leaves parts that expire and that no entry names. A dead batch's parts are read to
delete the payloads they name, then deleted with them.

A batch of more than ``batch_tx_samples`` samples (:class:`~streamrl.coordinator.config.CoordinatorConfig`) is
moved in pieces, so that no transaction holds Redis for long: first a :class:`Building` record (the batch's index,
its manifest, its groups) is SET - with the parts PERSISTed - on the same compare-and-set; then each piece of groups
of at most that many samples is moved (payloads renamed, buffers deleted, out of ``ready``) in a transaction of its
own; the last transaction XADDs the manifest, sets ``batch_index`` to ``k + 1`` and deletes the record. A
coordinator that died in between finds the record (:meth:`BatchBuilder.finish_building`, before any new batch):
the groups of the record still in ``ready`` are the ones not moved yet; it moves them and publishes the batch.

Each batch is the root of a trace of its own (``coordinator.batch``, its traceparent the batch's), and
the traced samples' waits in their group and for the batch are recorded as it is built (``traces.py``).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from streamrl.common.batch_payloads import batch_keys, owned_buffers, split_refs
from streamrl.common.bus import Bus
from streamrl.common.codec import decode, encode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import MANIFEST_PART_BYTES, BatchManifest, ManifestPart, SampleRef, ScoredRecord
from streamrl.common.payloads import read_payloads, write_payloads
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.trace_schema import BATCH, BATCH_ID, NUM_SAMPLES, POLICY_VERSION, STEP_INDEX
from streamrl.common.telemetry.tracing import NULL_TRACING, Attributes, Tracing
from streamrl.common.tx import PreconditionFailed, Tx
from streamrl.coordinator import state as st
from streamrl.coordinator.admission import staleness
from streamrl.coordinator.batch_metrics import RecordBatch
from streamrl.coordinator.batching import ReadyGroup, Selection, last_batch, last_chance, select_groups
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.scripts import FencedScript
from streamrl.coordinator.state import RunState
from streamrl.coordinator.traces import record_waits

logger = logging.getLogger(__name__)

_PART_ENVELOPE_BYTES = 256
"""What a ManifestPart adds to its refs (type, version, batch id, number): parts stay within their budget."""

DEAD_BATCH_LUA = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('INCR', KEYS[2]); redis.call('INCRBY', KEYS[3], ARGV[2]); redis.call('INCRBY', KEYS[4], ARGV[3])
for i = 5, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""
"""Count a dead-lettered batch once, deleting its samples. KEYS: dead_batch_ids, batches_dead, samples_dead,
batch_groups_dead, then the hashes holding its samples; ARGV: id, samples, groups."""
RESEND_LUA = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return -1 end
local n = redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
if n > tonumber(ARGV[2]) then return 0 end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'd', ARGV[4])
return n
"""
"""Send a refused batch again, at most ARGV[2] times. KEYS: dead_batch_ids, batch_resends, batches; ARGV:
id, limit, maxlen, payload. Reply: the resend's number, 0 (limit reached) or -1 (already counted dead)."""


class Building(msgspec.Struct, frozen=True):
    """A batch being moved under its id in pieces (``state:building``): what a restarted coordinator finishes."""

    index: int
    manifest: BatchManifest
    """What the last piece publishes (its parts, when split, already PERSISTed)."""
    groups: list[str]
    """The batch's groups: those still in ``ready`` are not moved yet."""


_building_decoder = msgspec.msgpack.Decoder(Building)


def pieces(members: dict[str, list[ScoredRecord]], max_samples: int) -> list[dict[str, list[ScoredRecord]]]:
    """``members`` (groups and their records) in consecutive pieces of at most ``max_samples`` records each (a
    group bigger than that alone in its piece), in order (pure)."""
    out: list[dict[str, list[ScoredRecord]]] = []
    current: dict[str, list[ScoredRecord]] = {}
    count = 0
    for group, records in members.items():
        if current and count + len(records) > max_samples:
            out.append(current)
            current, count = {}, 0
        current[group] = records
        count += len(records)
    if current:
        out.append(current)
    return out


@dataclass(frozen=True)
class Built:
    """A batch published (``manifest``; ``batch``: its records), with the samples dropped as too stale while it
    was built."""

    batch: RecordBatch
    manifest: BatchManifest
    num_too_stale: int
    waited_s: float = 0.0
    """How long it waited for in-flight groups whose last batch it was (``coordinator.batch_wait_s``)."""


class BatchBuilder:
    """Builds every batch the ready groups allow (see the module docstring)."""

    def __init__(
        self,
        state: RunState,
        groups: GroupBuffer,
        *,
        prompts_per_step: int,
        max_staleness: int,
        drop_stale: bool,
        tracing: Tracing = NULL_TRACING,
        manifest_part_bytes: int = MANIFEST_PART_BYTES,
        tx_samples: int = 256,
        wait_s: float = 30.0,
    ) -> None:
        self.state = state
        self.wait_s = wait_s
        """The longest a batch waits for in-flight groups whose last batch it is (``batching.py``)."""
        self.waiting: tuple[int, float] | None = None
        """(batch index, monotonic time) since when that batch waits for such groups."""
        self.tx_samples = tx_samples
        """A batch of more samples than this is moved in pieces (see the module docstring)."""
        self.manifest_part_bytes = manifest_part_bytes
        """A manifest whose refs encode to more than this is published split (see the module docstring)."""
        self.groups = groups
        self.per_step = prompts_per_step
        self.max_staleness = max_staleness
        self.drop_stale = drop_stale
        self.tracing = tracing
        self._dead_batch = FencedScript(state.bus, DEAD_BATCH_LUA, "batches.DEAD_BATCH_LUA")
        self._resend = FencedScript(state.bus, RESEND_LUA, "batches.RESEND_LUA")
        self.too_stale_since_batch = 0
        """Samples dropped as too stale since the last batch was built (reported with the next one)."""

    async def build(self, version: int) -> list[Built]:
        """Publish every batch that can be built now; ``version`` = the policy version now."""
        redis = self.state.redis
        built: list[Built] = []
        await self.finish_building()
        while await redis.llen(self.state.key(st.READY)) >= self.per_step:
            stored_index = await self.state.get_raw(st.BATCH_INDEX)
            index = int(stored_index) if stored_index is not None else 0
            ready_ids = await self.groups.ready()
            members = await self.groups.samples(ready_ids)
            ready = [ReadyGroup(g, min(s.trajectory.policy_version_start for s in members[g])) for g in ready_ids]
            pick = await self._select(ready, index)
            if pick.too_stale:
                num = sum(len(members[g.group_id]) for g in pick.too_stale)
                tx = self.state.tx().require(self.state.key(st.BATCH_INDEX), equals=stored_index)
                self.groups.queue_drop_ready(
                    tx, {g.group_id: members[g.group_id] for g in pick.too_stale}, max(index - self.max_staleness, 0)
                )
                tx.incrby(self.state.key(st.SAMPLES_TOO_STALE), num)
                if not await self._execute(tx, index):
                    continue
                self.too_stale_since_batch += num
                logger.warning(
                    "dropped %d groups (%d samples) over max_staleness=%d for batch %d",
                    len(pick.too_stale),
                    num,
                    self.max_staleness,
                    index,
                )
            if not pick.chosen:
                break
            samples = [s for g in pick.chosen for s in members[g.group_id]]
            batch_id = f"batch-{index}"
            attributes: Attributes = {
                BATCH_ID: batch_id,
                STEP_INDEX: index,
                POLICY_VERSION: version,
                NUM_SAMPLES: len(samples),
            }
            span = self.tracing.span(BATCH, attributes=attributes)
            created = time.time()
            record_waits(self.tracing, samples, batch_id=batch_id, built_at=created)
            batch = RecordBatch(
                id=batch_id,
                index=index,
                samples=samples,
                policy_version=version,
                staleness=[staleness(index, s.trajectory.policy_version_start) for s in samples],
                created_at=created,
                traceparent=span.traceparent,
            )
            manifest = self._manifest(batch)
            published_manifest = await self._store_parts(manifest)
            chosen = {g.group_id: members[g.group_id] for g in pick.chosen}
            if len(samples) > self.tx_samples:
                published = await self._publish_in_pieces(
                    stored_index, Building(index, published_manifest, [*chosen]), chosen
                )
            else:
                tx = self.state.tx().require(self.state.key(st.BATCH_INDEX), equals=stored_index)
                self.groups.queue_batched(tx, chosen, batch_id)  # first: renames the payloads
                for key in published_manifest.parts:
                    tx.call("PERSIST", key)
                tx.xadd(self.state.names.batches, published_manifest)
                tx.set(self.state.key(st.BATCH_INDEX), index + 1)
                published = await self._execute(tx, index)
            span.end()
            if not published:
                continue
            built.append(Built(batch, manifest, self.too_stale_since_batch, self._waited_s(index)))
            self.too_stale_since_batch = 0
            self.waiting = None
        return built

    async def _select(self, ready: list[ReadyGroup], index: int) -> Selection:
        """The groups of batch ``index`` (``batching.py``), waiting for the in-flight groups whose last batch it
        is - at most ``wait_s`` from the first time it could have been built without them."""

        def select(coming: int) -> Selection:
            return select_groups(
                ready,
                index=index,
                max_staleness=self.max_staleness,
                per_step=self.per_step,
                drop_stale=self.drop_stale,
                last_chance_in_flight=coming,
            )

        now = select(0)
        if not self.wait_s or all(last_batch(g.oldest_version, self.max_staleness) <= index for g in now.chosen):
            return now  # no group of it could go to a later batch: nothing to wait for (no read)
        waiting = select(
            last_chance(await self.groups.coming_versions(), index=index, max_staleness=self.max_staleness)
        )
        if not waiting.waiting_for:
            return waiting
        if self.waiting is None or self.waiting[0] != index:
            self.waiting = (index, time.monotonic())
        if self._waited_s(index) <= self.wait_s:
            return waiting
        logger.warning(
            "batch %d waited %.1f s (coordinator.batch_wait_s) for %d in-flight groups whose last batch it is: "
            "built without them, they will be too stale when they complete",
            index,
            self._waited_s(index),
            waiting.waiting_for,
        )
        return now

    def _waited_s(self, index: int) -> float:
        """How long batch ``index`` has waited for in-flight groups (0 when it has not)."""
        return time.monotonic() - self.waiting[1] if self.waiting is not None and self.waiting[0] == index else 0.0

    async def _publish_in_pieces(
        self, stored_index: bytes | None, building: Building, members: dict[str, list[ScoredRecord]]
    ) -> bool:
        """Record ``building`` (its parts PERSISTed), then move its groups and publish it (module docstring); False
        when ``batch_index`` moved under this coordinator (nothing more written)."""
        tx = self.state.tx().require(self.state.key(st.BATCH_INDEX), equals=stored_index)
        tx.require(self.state.key(st.BUILDING), equals=None)
        for key in building.manifest.parts:
            tx.call("PERSIST", key)
        tx.set(self.state.key(st.BUILDING), msgspec.msgpack.encode(building))
        if not await self._execute(tx, building.index):
            return False
        return await self._move_and_publish(stored_index, building, members)

    async def _move_and_publish(
        self, stored_index: bytes | None, building: Building, members: dict[str, list[ScoredRecord]]
    ) -> bool:
        """Move ``members`` (the groups of ``building`` not moved yet) under the batch, a piece per transaction,
        then publish it; False when ``batch_index`` moved under this coordinator."""
        for piece in pieces(members, self.tx_samples):
            tx = self.state.tx().require(self.state.key(st.BATCH_INDEX), equals=stored_index)
            self.groups.queue_batched(tx, piece, building.manifest.id)
            if not await self._execute(tx, building.index):
                return False
        tx = self.state.tx().require(self.state.key(st.BATCH_INDEX), equals=stored_index)
        tx.xadd(self.state.names.batches, building.manifest)
        tx.set(self.state.key(st.BATCH_INDEX), building.index + 1)
        tx.delete(self.state.key(st.BUILDING))
        return await self._execute(tx, building.index)

    async def finish_building(self) -> bool:
        """Finish a batch a previous coordinator began to move in pieces and did not publish (its record in
        ``state:building``): True when one was published now."""
        stored = await self.state.get_raw(st.BUILDING)
        if stored is None:
            return False
        try:
            building = _building_decoder.decode(stored)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise RuntimeError(f"state:building holds no batch record ({e}): no batch can be built past it") from e
        stored_index = await self.state.get_raw(st.BATCH_INDEX)
        index = int(stored_index) if stored_index is not None else 0
        if building.index != index:  # (the last piece deletes it with the index moved: only written by hand)
            raise RuntimeError(
                f"state:building holds batch {building.index} but batch_index is {index}: the run state was edited "
                f"by hand; delete the key if batch {building.index} is on the batches stream"
            )
        ready = set(await self.groups.ready())
        todo = [g for g in building.groups if g in ready]
        logger.warning(
            "%s: finishing the batch a previous coordinator began: %d of its %d groups still to move",
            building.manifest.id,
            len(todo),
            len(building.groups),
        )
        return await self._move_and_publish(stored_index, building, await self.groups.samples(todo))

    def _manifest(self, batch: RecordBatch) -> BatchManifest:
        """The manifest of ``batch``: per sample its scored record and its payload's key under the batch."""
        refs = [
            SampleRef(
                trajectory_id=s.trajectory.id,
                group_id=s.trajectory.group_id,
                key=self.groups.batched(batch.id, s.trajectory.id),
                field="",
                policy_version_start=s.trajectory.policy_version_start,
                num_bytes=s.trajectory.payload_bytes,
                traceparent=s.traceparent,
                scored=s,
            )
            for s in batch.samples
        ]
        return BatchManifest(
            id=batch.id,
            index=batch.index,
            samples=refs,
            policy_version=batch.policy_version,
            staleness=batch.staleness,
            created_at=batch.created_at,
            traceparent=batch.traceparent,
        )

    async def _store_parts(self, manifest: BatchManifest) -> BatchManifest:
        return await store_parts(self.state.bus, self.state.names, manifest, self.manifest_part_bytes)

    async def _part_buffers(self, batch_id: str, keys: Sequence[str]) -> list[str]:
        """The payloads the manifest parts among ``keys`` name; when a part is gone (or unreadable), every key still
        under the batch's prefix: nothing else names the payloads of a lost part."""
        prefix = self.state.names.batched_samples(batch_id, "manifest:")
        parts = [k for k in keys if k.startswith(prefix)]
        values = await read_payloads(
            self.state.redis,
            parts,
            [self.manifest_part_bytes] * len(parts),
            max_reply_bytes=self.state.bus.max_command_bytes,
        )
        found: list[str] = []
        lost = 0
        for value in values:
            try:
                found += [ref.key for ref in decode(value, ManifestPart).samples] if value is not None else []
            except PoisonMessageError:
                value = None
            lost += value is None
        if lost:
            found = await batch_keys(self.state.redis, self.state.names, batch_id)
            logger.warning(
                "%s: %d of its manifest parts are gone or unreadable: deleting the %d keys still under the batch",
                batch_id,
                lost,
                len(found),
            )
        return found

    async def _execute(self, tx: Tx, index: int) -> bool:
        """Run a transaction conditioned on ``batch_index`` still being ``index``; False when it was not
        (another builder moved it: nothing was written, the caller reads the state again)."""
        try:
            await tx.execute()
        except PreconditionFailed as e:
            logger.warning("batch %d: the run state moved under this coordinator (%s); reading it again", index, e)
            return False
        return True

    async def record_dead(
        self, batch_id: str, num_samples: int, num_groups: int | None, reason: str, buffers: Sequence[str] = ()
    ) -> bool:
        """Count a batch the learner dead-lettered as dropped (once per id), deleting those of ``buffers`` (the
        hashes its letter's manifest names) that hold its samples (named under its id: a conflicting or forged
        manifest naming another batch's never deletes them); False when it was counted before."""
        k = self.state.key
        owned = owned_buffers(self.state.names, batch_id, [*buffers, *await self._part_buffers(batch_id, buffers)])
        keys = [k(st.DEAD_BATCH_IDS), k(st.BATCHES_DEAD), k(st.SAMPLES_DEAD), k(st.BATCH_GROUPS_DEAD), *owned]
        fresh = bool(await self._dead_batch(keys, [batch_id, num_samples, num_groups or 0]))
        if fresh:
            groups = f"{num_groups} groups, " if num_groups is not None else ""
            logger.error(
                "%s (%s%d samples) was dead-lettered by the learner: its groups are dropped, never trained: %s",
                batch_id,
                groups,
                num_samples,
                reason,
            )
        return fresh

    async def resend(self, batch_id: str, payload: bytes, *, limit: int, reason: str) -> bool:
        """Send again a batch the learner refused unconsumed (``payload``: its entry); False when it was sent
        ``limit`` times already (the caller counts it dropped) or was counted dropped before."""
        keys = [self.state.key(st.DEAD_BATCH_IDS), self.state.key(st.BATCH_RESENDS), self.state.names.batches]
        sent = await self._resend(keys, [batch_id, limit, self.state.bus.maxlen, payload])
        if sent > 0:
            logger.warning(
                "%s was refused by the learner without being consumed (%s): sent again (%d of %d)",
                batch_id,
                reason,
                sent,
                limit,
            )
        return sent > 0


async def store_parts(bus: Bus, names: StreamNames, manifest: BatchManifest, part_bytes: int) -> BatchManifest:
    """What to publish of ``manifest``: itself when its refs fit in one part of ``part_bytes``, else its header
    naming its parts, written now under ``names`` (plain SETs, bounded, with the orphan time to live the
    publishing transaction removes by PERSISTing each of the header's ``parts``)."""
    runs = split_refs(manifest.samples, part_bytes - _PART_ENVELOPE_BYTES)
    if len(runs) <= 1:
        return manifest
    attempt = secrets.token_hex(8)
    items = [
        (
            names.manifest_part(manifest.id, attempt, n),
            encode(ManifestPart(batch_id=manifest.id, number=n, samples=run)),
        )
        for n, run in enumerate(runs)
    ]
    await write_payloads(bus.redis, items, ttl_s=bus.payload_orphan_ttl_s, max_command_bytes=bus.max_command_bytes)
    return msgspec.structs.replace(
        manifest, samples=[], parts=[key for key, _ in items], part_bytes=[len(value) for _, value in items]
    )
