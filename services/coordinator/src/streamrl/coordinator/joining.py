"""The joiner: a run's K lanes feed the one learner (:mod:`streamrl.common.lanes`).

With ``lanes.count = K > 1`` every lane's coordinator builds *lane batches* (index 0, 1, ... of
``prompts_per_step / K`` groups each) on its lane's ``batches`` stream, and the learner trains from the home's.
Lane 0's coordinator also runs the joiner (:func:`run_joiner`), holding the home lease ``singleton/joiner``
(its home writes are fenced by it), with a bus on the home Redis and one per lane. It does three things:

1. **Weights mirror** (:mod:`streamrl.coordinator.mirror`). Each home ``weights`` entry is copied, as it is
   (signed for the run), into every lane's ``weights``, by one mirror per lane: a lane whose Redis is down delays
   only its own copies. Lane 0's coordinator, which ends the run, ends it only once every lane has the last
   version (:class:`~streamrl.coordinator.mirror.Mirrored`).
2. **Join.** A consumer loop per lane (group ``joiner`` on the lane's ``batches``) stores each lane batch
   in the home (hash ``state:joiner_batch:{index}``, field = lane) and sets the lane's mark
   (``state:joiner_lane{k}``: its last entry id and index) in one fenced transaction conditioned on the
   mark read; the entry is acknowledged after that (a redelivered entry finds itself under the mark).
   The joining itself is a loop of its own (woken by each store): when every lane has its batch at the next
   index ``s`` (``state:batch_index``, the key the learner reads to tell a lost index from one still to come),
   one home transaction,
   conditioned on ``batch_index`` still being ``s``, XADDs ONE :class:`BatchManifest` to the home
   ``batches`` - id ``batch-{s}``, index ``s``, the lanes' samples concatenated in lane order (their keys
   stay their lane's: ``streamrl:{run/lanek}:batched:batch-{s}:...``), their staleness concatenated,
   ``policy_version`` the lanes' max, the first lane's trace context - and sets ``batch_index`` to
   ``s + 1``: index ``s`` is never published twice, whatever restarts or lost replies (the transaction's
   ``once`` key) come between. A joined manifest whose refs pass :data:`MANIFEST_PART_BYTES` is split into
   home parts exactly as a coordinator splits its own (:func:`streamrl.coordinator.batches.store_parts`).
   A lane batch that cannot be read whole any more (a manifest part lost: evicted, deleted, a Redis restarted
   without its data) never stalls the run: index ``s`` is joined from the other lanes, and that lane gets, on
   its ``dead``, a letter naming its ``batch-{s}`` ``skipped untrained`` with the samples still under the batch
   (found by key, :func:`~streamrl.common.batch_payloads.batch_keys`), so its coordinator counts their groups
   dropped and deletes what is left of them; later indices proceed.
   After it, the lane manifests' own parts (which no entry needs any more) are deleted and the stored lane
   batches dropped; an index joined but not yet cleaned up (``state:joiner_cleanup``) is finished at the
   next start.
3. **Relay.** What the learner says about a joined batch on the home ``dead`` stream goes back to the lanes
   as their coordinators expect it today. A batch it skipped untrained: each lane gets, on its ``dead``, a
   letter naming its own ``batch-{s}`` on its ``batches`` stream, holding the lane's share of the joined
   manifest (its samples; split into lane parts when big), ``skipped untrained`` and the learner's reason -
   so each lane counts its groups dropped and deletes their payloads as today. A batch the learner refused
   unconsumed is sent again on the home (the coordinator's own resend script and limit,
   ``consumer.max_deliveries - 1`` times), and relayed as skipped once refused too often. Each lane's relay
   mark (``state:dead_relayed``) is set in the transaction that writes the letter: relayed once. Any other home
   letter (not about a batch: a weights entry the learner refused, an entry of a stream it cannot read) goes to
   lane 0's ``dead`` as it is, where lane 0's coordinator counts it and shows its reason.

Each part - a lane's consumer loop, a lane's mirror, the joining, the relay - outlasts a Redis outage longer
than the client rides out (:func:`streamrl.common.bus.outlast`): it says so and tries again, so one lane down
delays only what needs that lane, and lane 0's coordinator never exits for another lane's outage. (The home's
outage ends the joiner through its lease, as before.) The lanes' consumer loops are in the coordinator's
heartbeat (``ctx.loops``).

Bad input never passes silently: a lane entry whose id is not ``batch-{index}``, that names keys not of its
lane's batch (a manifest of another run or lane), or whose index is not the lane's next (one joined
already, or one skipping an index) is not joined; a dead letter on the lane's ``dead`` names it (its
``stream`` the home ``batches``, so the lane coordinator counts it and neither resends nor drops a batch
for it), acknowledged with the entry, and one error line says it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import redis.asyncio as aioredis

from streamrl.common.aio import cancel_and_wait, wait_set
from streamrl.common.batch_payloads import MissingPayloadError, batch_keys, load_manifest, owned_buffers
from streamrl.common.bus import PAYLOAD_FIELD, Bus, Output, connect, outlast
from streamrl.common.codec import decode, encode
from streamrl.common.config import ConsumerConfig
from streamrl.common.consumer import ConsumerLoop, current_entry
from streamrl.common.errors import PoisonMessageError
from streamrl.common.follower import StreamFollower
from streamrl.common.lanes import lane_names, resolve_url
from streamrl.common.lease import Lease, holder_token
from streamrl.common.lifecycle import ServiceConfig, ServiceContext, bus_of
from streamrl.common.messages import (
    BATCH_SKIPPED,
    MANIFEST_PART_BYTES,
    BatchManifest,
    DeadLetter,
    Message,
    SampleRef,
)
from streamrl.common.replies import text
from streamrl.common.streams import StreamNames
from streamrl.common.tx import Fence, PreconditionFailed
from streamrl.common.weights.auth import sign, weights_key
from streamrl.coordinator import state as st
from streamrl.coordinator.batches import RESEND_LUA, store_parts
from streamrl.coordinator.dead_letters import ForgedLetter, LostBatch, RefusedBatch, what_was_lost
from streamrl.coordinator.mirror import Lane, Mirrored, after, mirror_lane
from streamrl.coordinator.scripts import FencedScript

logger = logging.getLogger(__name__)

GROUP = "joiner"
"""The joiner's consumer group (and consumer name) on each lane's ``batches``."""
NEXT = "batch_index"
"""Home state: the next index to join."""
CLEANUP = "joiner_cleanup"
"""Home state: indices joined whose lane batches are still to clean up."""
DEAD_CURSOR = "joiner_dead_cursor"
"""Home state: the last home ``dead`` entry relayed to every lane."""
RELAYED = "dead_relayed"
"""Lane state: the last home ``dead`` entry relayed into the lane."""
BLOCK_MS = 200
JOIN_CHECK_S = 1.0
"""The joining looks again this often without a store waking it (a lane back from an outage)."""
OUTAGE_RETRY_S = 5.0
"""A part of the joiner whose Redis outlasted the client's retries is run again this long after."""


def _raw(payload: bytes | str) -> bytes:
    return payload.encode() if isinstance(payload, str) else payload


def lane_mark(lane: int) -> str:
    """Home state: lane ``lane``'s last stored entry, ``"{entry id} {index}"``."""
    return f"joiner_lane{lane}"


def stored_batches(index: int) -> str:
    """Home state: the lane batches of ``index`` waiting to be joined (field: the lane, value: its manifest)."""
    return f"joiner_batch:{index}"


def lane_entry_problem(manifest: BatchManifest, lane: int, names: StreamNames, last_index: int) -> str | None:
    """Why lane ``lane``'s entry ``manifest`` cannot be joined (None: it can); ``last_index``: the lane's last
    stored index (-1: none)."""
    where = f"lane {lane}'s {manifest.id} (index {manifest.index})"
    if manifest.id != f"batch-{manifest.index}":
        return f"{where}: a lane batch's id is batch-{{index}}; not joined"
    foreign = [k for k in manifest.buffers if k not in owned_buffers(names, manifest.id, [k])]
    if foreign:
        return (
            f"{where} names {len(foreign)} keys not of its batch in lane {lane} of run {names.run_id!r} (first: "
            f"{foreign[0]}): a manifest of another run or lane; not joined"
        )
    if manifest.index <= last_index:
        return f"{where}: index {manifest.index} was taken already (lane {lane} is joined up to {last_index}); not joined again"
    if manifest.index != last_index + 1:
        return f"{where}: lane {lane}'s next index is {last_index + 1}, it skips to {manifest.index}; not joined"
    return None


def join_manifests(index: int, manifests: Sequence[BatchManifest], created_at: float) -> BatchManifest:
    """The one batch of ``index`` from the lanes' (whole, in lane order): samples and staleness concatenated,
    the newest policy version."""
    for m in manifests:
        if m.index != index or (m.parts and not m.samples):
            raise ValueError(f"join of index {index}: got {m.id} (index {m.index}, {len(m.parts)} parts unread)")
    return BatchManifest(
        id=f"batch-{index}",
        index=index,
        samples=[s for m in manifests for s in m.samples],
        policy_version=max((m.policy_version for m in manifests), default=0),
        staleness=[x for m in manifests for x in m.staleness],
        created_at=created_at,
        traceparent=manifests[0].traceparent if manifests else "",
    )


def lane_share(joined: BatchManifest, names: StreamNames) -> BatchManifest:
    """What of the whole ``joined`` manifest is the lane's of ``names``: its samples (by key), their staleness."""
    prefix = names.batched_samples(joined.id, "")
    picked = [i for i, s in enumerate(joined.samples) if s.key.startswith(prefix)]
    return msgspec.structs.replace(
        joined,
        samples=[joined.samples[i] for i in picked],
        staleness=[joined.staleness[i] for i in picked if i < len(joined.staleness)],
        parts=[],
        part_bytes=[],
    )


class Joiner:
    """Mirrors weights into the lanes, joins their batches, relays the learner's letters (module docstring)."""

    def __init__(
        self,
        home: Bus,
        home_names: StreamNames,
        lanes: Sequence[Lane],
        consumer: ConsumerConfig,
        *,
        part_bytes: int = MANIFEST_PART_BYTES,
        mirrored: Mirrored | None = None,
        outage_retry_s: float = OUTAGE_RETRY_S,
        key: bytes | None = None,
    ) -> None:
        self.home = home
        self.letter_key = key
        """The run's weights key: the learner's letters must be signed with it, and the relayed ones are."""
        self.names = home_names
        self.lanes = list(lanes)
        self.consumer = consumer
        self.part_bytes = part_bytes
        self.resend_limit = consumer.max_deliveries - 1
        self.mirrored = mirrored if mirrored is not None else Mirrored([-1] * len(self.lanes))
        self.outage_retry_s = outage_retry_s
        self._lock = asyncio.Lock()
        self._stored = asyncio.Event()
        self._resend = FencedScript(home, RESEND_LUA, "batches.RESEND_LUA")
        self.loops: list[ConsumerLoop[BatchManifest]] = [
            ConsumerLoop(
                lane.bus,
                lane.names,
                stream=lane.names.batches,
                group=GROUP,
                consumer=GROUP,
                handler=self._handler(k),
                message_type=BatchManifest,
                config=self.consumer,
            )
            for k, lane in enumerate(self.lanes)
        ]
        """One per lane, on its ``batches``: what the coordinator's heartbeat counts."""

    def key(self, name: str) -> str:
        return self.names.state(name)

    async def run(self, stop: asyncio.Event) -> None:
        """Mirror, join and relay until ``stop`` is set; each part outlasts its Redis's outages, a part that fails
        otherwise ends the others and raises."""
        parts: dict[str, Callable[[], Awaitable[None]]] = {}
        for k, loop in enumerate(self.loops):
            parts[f"lane {k}'s batches"] = functools.partial(loop.run, stop)
            parts[f"weights into lane {k}"] = functools.partial(
                mirror_lane, self.home, self.names, self.lanes, k, self.mirrored, stop
            )
        parts["joining"] = functools.partial(self.join_forever, stop)
        parts["the learner's letters"] = functools.partial(self.relay, stop)
        tasks = [
            asyncio.create_task(outlast(f"joiner: {what}", part, stop, retry_s=self.outage_retry_s))
            for what, part in parts.items()
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            await cancel_and_wait([t for t in tasks if not t.done()])

    # -- 2. batches ----------------------------------------------------------------------------
    def _handler(self, lane: int) -> Callable[[BatchManifest], Awaitable[list[Output]]]:
        async def handle(manifest: BatchManifest) -> list[Output]:
            entry_id = current_entry()
            async with self._lock:
                problem = await self._store(lane, entry_id, manifest)
            if problem is None:
                self._stored.set()
                return []
            logger.error("joiner: lane %d entry %s: %s", lane, entry_id, problem)
            letter = DeadLetter(
                stream=self.names.batches,
                entry_id=entry_id,
                group=GROUP,
                consumer=GROUP,
                error=problem,
                deliveries=1,
                payload=encode(manifest),
                ts=time.time(),
            )
            return [Output(stream=self.lanes[lane].names.dead, message=letter)]

        return handle

    async def _store(self, lane: int, entry_id: str, manifest: BatchManifest) -> str | None:
        """Keep lane ``lane``'s entry in the home until its index is joined; why not (None: kept, or kept before)."""
        mark_key = self.key(lane_mark(lane))
        raw = await self.home.redis.get(mark_key)
        last_entry, _, last_index = text(raw or b" -1").partition(" ")
        if last_entry and not after(entry_id, last_entry):
            return None  # stored before (a redelivery after a restart)
        problem = lane_entry_problem(manifest, lane, self.lanes[lane].names, int(last_index))
        if problem is not None:
            return problem
        tx = self.home.tx().require(mark_key, equals=raw)
        tx.hset(self.key(stored_batches(manifest.index)), lane, encode(manifest))
        tx.set(mark_key, f"{entry_id} {manifest.index}")
        await tx.execute()
        return None

    async def join_forever(self, stop: asyncio.Event) -> None:
        """Finish the clean-ups a previous life left, then join every index the lanes complete until ``stop``
        (woken by each store; every :data:`JOIN_CHECK_S` anyway)."""
        for index in sorted(int(i) for i in await self.home.redis.smembers(self.key(CLEANUP))):
            await self.clean_up(index)
        while not stop.is_set():
            self._stored.clear()
            async with self._lock:
                await self.join_ready()
            await wait_set(self._stored, JOIN_CHECK_S)

    async def join_ready(self) -> list[BatchManifest]:
        """Publish every index all lanes have stored, in order; the joined manifests (whole). A lane batch that
        cannot be read whole any more is left out of its index and dead-lettered to its lane (:meth:`_give_up`)."""
        joined: list[BatchManifest] = []
        while True:
            raw_next = await self.home.redis.get(self.key(NEXT))
            index = int(raw_next or 0)
            stored = await self.home.redis.hgetall(self.key(stored_batches(index)))
            if len(stored) < len(self.lanes):
                return joined
            whole = []
            for k, lane in enumerate(self.lanes):
                manifest = decode(_raw(stored[str(k).encode()]), BatchManifest)
                try:
                    whole.append(
                        await load_manifest(lane.bus.redis, manifest, max_reply_bytes=lane.bus.max_command_bytes)
                    )
                except (MissingPayloadError, PoisonMessageError) as e:
                    await self._give_up(k, manifest, str(e))
            batch = join_manifests(index, whole, time.time())
            published = await store_parts(self.home, self.names, batch, self.part_bytes)
            tx = self.home.tx().require(self.key(NEXT), equals=raw_next)
            for part in published.parts:
                tx.call("PERSIST", part)
            tx.xadd(self.names.batches, published)
            tx.set(self.key(NEXT), index + 1).sadd(self.key(CLEANUP), index)
            try:
                await tx.execute()
            except PreconditionFailed as e:
                logger.warning("joiner: index %d moved under this joiner (%s); reading it again", index, e)
                continue
            logger.info(
                "joiner: batch-%d published (%d samples from %d lanes%s)",
                index,
                len(batch.samples),
                len(whole),
                f", {len(published.parts)} parts" if published.parts else "",
            )
            joined.append(batch)
            await self.clean_up(index)

    async def _give_up(self, k: int, manifest: BatchManifest, reason: str) -> None:
        """Lane ``k``'s batch ``manifest`` cannot be read whole: tell the lane it was skipped untrained, naming the
        samples still under it (by key: the refs of a lost part are gone), so its coordinator counts their groups
        dropped and deletes them. Written before the index is published: a restart writes it again, which the
        lane counts once (by batch id)."""
        lane = self.lanes[k]
        prefix = lane.names.batched_samples(manifest.id, "")
        refs = [
            SampleRef(
                trajectory_id=key[len(prefix) :],
                group_id=key[len(prefix) :].rpartition("/")[0] or key[len(prefix) :],
                key=key,
                field="",
                policy_version_start=manifest.policy_version,
                num_bytes=0,
            )
            for key in sorted(await batch_keys(lane.bus.redis, lane.names, manifest.id))
            if not key.startswith(f"{prefix}manifest:")
        ]
        error = (
            f"{manifest.id} ({manifest.num_samples} samples) of lane {k}: {BATCH_SKIPPED}: {reason}; "
            f"batch-{manifest.index} is joined without it"
        )
        logger.error("joiner: %s", error)
        named = msgspec.structs.replace(manifest, samples=refs, staleness=[], parts=[], part_bytes=[])
        published = await store_parts(lane.bus, lane.names, named, self.part_bytes)
        letter = DeadLetter(
            stream=lane.names.batches,
            entry_id="",
            group=GROUP,
            consumer=GROUP,
            error=error,
            deliveries=1,
            payload=encode(published),
            ts=time.time(),
        )
        letter = sign(letter, self.letter_key, run_id=self.names.run_id)  # the lane's coordinator checks it
        tx = lane.bus.tx()
        for part in published.parts:
            tx.call("PERSIST", part)
        await tx.xadd(lane.names.dead, letter).execute()

    async def clean_up(self, index: int) -> None:
        """Delete the lane manifests' own parts of a joined index and what the home kept of them."""
        key = self.key(stored_batches(index))
        for field, value in (await self.home.redis.hgetall(key)).items():
            lane = self.lanes[int(field)]
            manifest = decode(_raw(value), BatchManifest)
            parts = owned_buffers(lane.names, manifest.id, manifest.parts)
            if parts:
                await lane.bus.redis.unlink(*parts)
        await self.home.tx().delete(key).srem(self.key(CLEANUP), index).execute()

    # -- 3. dead letters -----------------------------------------------------------------------
    async def relay(self, stop: asyncio.Event) -> None:
        """Hand what the learner dead-letters about joined batches back to the lanes."""
        cursor = text(await self.home.redis.get(self.key(DEAD_CURSOR)) or b"0-0")
        marks = [text(await lane.bus.redis.get(lane.names.state(RELAYED)) or b"") for lane in self.lanes]

        def decode_entry(fields: dict[bytes, bytes]) -> Message:
            return decode(fields.get(PAYLOAD_FIELD, b""))

        async def each(entries: list[tuple[str, Message]], last_id: str) -> str:
            for entry_id, msg in entries:
                if isinstance(msg, DeadLetter):
                    await self.relay_one(entry_id, msg, marks)
            await self.home.tx().set(self.key(DEAD_CURSOR), last_id).execute()
            return last_id

        await StreamFollower(self.home.redis, self.names.dead, decode_entry, each, block_ms=BLOCK_MS).run(cursor, stop)

    async def relay_one(self, entry_id: str, letter: DeadLetter, marks: list[str]) -> None:
        """Relay one home letter (``marks``: each lane's relay mark, updated in place)."""
        lost = what_was_lost(letter, batches_stream=self.names.batches, key=self.letter_key, run_id=self.names.run_id)
        if isinstance(lost, ForgedLetter):
            logger.error("joiner: not relayed to the lanes: %s", lost.reason)
            return
        if not isinstance(lost, LostBatch | RefusedBatch):
            if after(entry_id, marks[0]):
                marks[0] = await self._pass_on(entry_id, letter, marks[0])
            return
        reason = letter.error
        if isinstance(lost, RefusedBatch):
            keys = [self.key(st.DEAD_BATCH_IDS), self.key(st.BATCH_RESENDS), self.names.batches]
            sent = await self._resend(keys, [lost.batch_id, self.resend_limit, self.home.maxlen, lost.payload])
            if sent != 0:  # sent again (or counted dead before: relayed then)
                if sent > 0:
                    logger.warning(
                        "joiner: %s refused by the learner unconsumed (%s): sent again", lost.batch_id, reason
                    )
                return
            reason = f"refused {self.resend_limit + 1} times, last: {reason}"
        await self.home.tx().sadd(self.key(st.DEAD_BATCH_IDS), lost.batch_id).execute()
        joined = await self._whole(letter)
        for k in reversed(range(len(self.lanes))):
            if after(entry_id, marks[k]):
                marks[k] = await self._relay_to(k, entry_id, letter, lost, joined, reason, marks[k])
        if joined is not None:
            parts = owned_buffers(self.names, lost.batch_id, self._header_parts(letter))
            if parts:
                await self.home.redis.unlink(*parts)

    async def _pass_on(self, entry_id: str, letter: DeadLetter, mark: str) -> str:
        """Hand a home letter not about a batch to lane 0's ``dead`` as it is (its coordinator counts it and shows
        its reason); lane 0's relay mark after."""
        lane = self.lanes[0]
        key = lane.names.state(RELAYED)
        tx = lane.bus.tx().require(key, equals=mark or None)
        tx.xadd(lane.names.dead, letter).set(key, entry_id)
        try:
            await tx.execute()
        except PreconditionFailed:
            return text(await lane.bus.redis.get(key) or b"")
        return entry_id

    def _header_parts(self, letter: DeadLetter) -> list[str]:
        try:
            return list(decode(letter.payload, BatchManifest).parts)
        except PoisonMessageError:
            return []

    async def _whole(self, letter: DeadLetter) -> BatchManifest | None:
        """The joined manifest a letter holds, its parts read (None: cut, or its parts gone)."""
        try:
            header = decode(letter.payload, BatchManifest)
            return await load_manifest(self.home.redis, header, max_reply_bytes=self.home.max_command_bytes)
        except (PoisonMessageError, MissingPayloadError) as e:
            logger.warning("joiner: the learner's letter on %s holds no readable manifest (%s)", letter.stream, e)
            return None

    async def _relay_to(
        self,
        k: int,
        entry_id: str,
        letter: DeadLetter,
        lost: LostBatch | RefusedBatch,
        joined: BatchManifest | None,
        reason: str,
        mark: str,
    ) -> str:
        """Write lane ``k``'s letter for the lost joined batch; the lane's relay mark after."""
        lane = self.lanes[k]
        share = lane_share(joined, lane.names) if joined is not None else None
        count = share.num_samples if share is not None else lost.num_samples // len(self.lanes)
        published = await store_parts(lane.bus, lane.names, share, self.part_bytes) if share is not None else None
        error = (
            f"{lost.batch_id} ({count} samples) of lane {k}, in the joined {lost.batch_id}: {BATCH_SKIPPED}: {reason}"
        )
        relayed = DeadLetter(
            stream=lane.names.batches,
            entry_id=entry_id,
            group=letter.group,
            consumer=letter.consumer,
            error=error,
            deliveries=letter.deliveries,
            payload=encode(published) if published is not None else b"",
            ts=letter.ts,
        )
        relayed = sign(relayed, self.letter_key, run_id=self.names.run_id)  # the lane's coordinator checks it
        key = lane.names.state(RELAYED)
        tx = lane.bus.tx().require(key, equals=mark or None)
        for part in published.parts if published is not None else []:
            tx.call("PERSIST", part)
        tx.xadd(lane.names.dead, relayed).set(key, entry_id)
        try:
            await tx.execute()
        except PreconditionFailed:
            return text(await lane.bus.redis.get(key) or b"")
        logger.error("joiner: %s relayed to lane %d as lost: %s", lost.batch_id, k, reason)
        return entry_id


async def run_joiner(config: ServiceConfig, ctx: ServiceContext, stop: asyncio.Event, mirrored: Mirrored) -> None:
    """Run the joiner of lane 0's coordinator until ``stop``: connect to the home and every lane, take the home
    lease ``singleton/joiner`` (renewed; lost, the joiner raises), fence the home bus by it. ``mirrored``: where
    it says which version each lane has; its consumer loops join ``ctx.loops`` (the heartbeat)."""
    assert config.redis.url is not None
    home_names = StreamNames(config.run_id)
    clients: dict[str, aioredis.Redis] = {}

    def client(url: str) -> aioredis.Redis:
        if url not in clients:
            clients[url] = connect(url, outage_s=config.redis.outage_s, max_connections=config.redis.max_connections)
        return clients[url]

    lanes = []
    for k in range(config.lanes.count):
        names = lane_names(config.run_id, k)
        if k == config.lane:
            lanes.append(Lane(ctx.bus, names))  # this coordinator's own: fenced by its lease
            continue
        url = await resolve_url(config.lanes.url(k, config.redis.url), names.prompts, outage_s=math.inf)  # outlasted
        lanes.append(Lane(bus_of(client(url), config.redis, ctx.service), names))
    home = bus_of(
        client(await resolve_url(config.redis.url, home_names.prompts, outage_s=config.redis.outage_s)),
        config.redis,
        ctx.service,
    )  # a cluster: the home's node
    token = holder_token(ctx.instance)
    ttl_s = config.consumer.lease_ttl
    lease = Lease(
        home.redis, home_names.lease("singleton", "joiner"), token, ttl_s, f"the joiner of run {config.run_id!r}"
    )
    renewing: asyncio.Task[None] | None = None
    try:
        if not await lease.acquire(wait_s=1.25 * ttl_s, stop=stop):
            return
        home.fence = Fence(lease.key, token)

        async def renew() -> None:
            while True:
                await asyncio.sleep(ttl_s / 3)
                await lease.renew()

        renewing = asyncio.create_task(renew())
        joiner = Joiner(home, home_names, lanes, config.consumer, mirrored=mirrored, key=weights_key())
        ctx.loops.extend(joiner.loops)
        joining = asyncio.create_task(joiner.run(stop))
        done, _ = await asyncio.wait([renewing, joining], return_when=asyncio.FIRST_COMPLETED)
        await cancel_and_wait([t for t in (renewing, joining) if t not in done])
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        await lease.release()
    finally:
        for redis in clients.values():
            await redis.aclose()
