"""The consumer loop, written once. Services write handlers, never loops.

For one (stream, consumer group, consumer name)::

    XGROUP CREATE (from the start of the stream, tolerating BUSYGROUP)
    queue what this consumer name left pending in a previous life (XPENDING; no delivery counted)
    loop until stop:
        start queued entries (XCLAIM to itself: counts the delivery as it starts) before new ones;
            an entry on its last allowed delivery (max_deliveries, after one that never finished)
            takes every in-flight slot: it runs alone, so an entry that kills its consumer is the
            only one charged for it
        XREADGROUP > (up to the free in-flight slots)  -> one task per entry
        every claim_idle_ms / 3 at most: refresh the idle time of what this consumer holds (XCLAIM
            JUSTID: no delivery counted; also while every slot is busy: a saturated consumer keeps
            its entries)
        every claim_interval_s: queue the entries of dead peers (:mod:`streamrl.common.peers`) and
            entries idle > claim_idle_ms (XPENDING IDLE + XCLAIM JUSTID), and trim the stream to
            what its groups still need (:mod:`streamrl.common.trim`)
    per entry:
        delivered > max_deliveries -- its earlier deliveries killed their consumer: dead-letter it
                                      before the handler runs ("killed its consumer N times")
        decode            -- PoisonMessageError: dead-letter at once
        outputs = await handler(message)
        commit(outputs)   -- one atomic script: if the entry is still pending, XADD/HSET outputs
                             and XACK; else nothing (a duplicate: re-sent, or handled elsewhere)
        on failure        -- after max_deliveries deliveries: dead-letter with the error, ack;
                             otherwise pause retry_delay_s and XCLAIM it again (counts a delivery)
        LeaseLostError    -- the commit was fenced off (another process holds this service's
                             lease): the loop stops and run() raises it
    on stop (SIGTERM): no new reads; in-flight entries get shutdown_grace_s to finish, then are
    cancelled and stay pending for another consumer to reclaim.

A handler that waits for something other than its own work (a prompt for weights not yet served)
parks its entry (:meth:`ConsumerLoop.parked`): the entry then holds no in-flight slot, so waiting
entries never keep those that can run now from being read.

With ``ack=False`` the outputs are committed (while the entry is pending) but the entry stays
pending until the service acks it itself (the learner acks batches once a checkpoint covers them);
``on_committed`` is called after each commit.

At-least-once delivery to the handler, exactly-once effect downstream: a commit writes only while
its entry is pending (:mod:`streamrl.common.bus`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from redis.exceptions import ResponseError
from redis.typing import StreamIdT

from streamrl.common.aio import cancel_and_wait, timeout
from streamrl.common.bus import PAYLOAD_FIELD, Bus, CommitBatcher, OutageRetry, Output
from streamrl.common.codec import decode, encode
from streamrl.common.config import ConsumerConfig
from streamrl.common.errors import PoisonMessageError, RetryableError
from streamrl.common.lanes import home_run_id
from streamrl.common.lease import LeaseLostError
from streamrl.common.messages import DeadLetter, Message
from streamrl.common.peers import FORGET_LUA, PeerWatch, may_judge
from streamrl.common.redact import redact_url
from streamrl.common.replies import entries as entries_of
from streamrl.common.replies import entry_ids, pending, read_entries, text
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.tracing import set_delivery_attempt
from streamrl.common.trim import trim_consumed
from streamrl.common.weights.auth import sign

logger = logging.getLogger(__name__)

_CURRENT_ENTRY: contextvars.ContextVar[str] = contextvars.ContextVar("streamrl_current_entry", default="")


def current_entry() -> str:
    """The id of the entry whose handler is running (each entry's handler runs in its own task); "" outside."""
    return _CURRENT_ENTRY.get()


M = TypeVar("M", bound=Message)
DEAD_PAYLOAD_CUT = 64 * 2**10
"""Bytes of an oversized entry's payload kept in its dead letter."""
Handler = Callable[[M], Awaitable[list[Output]]]


@dataclass
class ConsumerStats:
    """Counters of one consumer loop, written into the instance heartbeat."""

    processed: int = 0
    skipped_duplicates: int = 0
    failed: int = 0
    retried: int = 0
    reclaimed: int = 0
    dead_lettered: int = 0
    in_flight: int = 0
    last_error: str = ""
    durations_s: list[float] = field(default_factory=list)


class ConsumerLoop(Generic[M]):
    """Consume ``stream`` as ``consumer`` in ``group`` and run ``handler`` on every message."""

    def __init__(
        self,
        bus: Bus,
        names: StreamNames,
        *,
        stream: str,
        group: str,
        consumer: str,
        handler: Handler[M],
        message_type: type[M] | tuple[type[Message], ...],
        config: ConsumerConfig,
        ack: bool = True,
        on_committed: Callable[[str, M], Awaitable[None]] | None = None,
        max_message_bytes: int | None = -1,
        letter_key: bytes | None = None,
    ) -> None:
        self.bus = bus
        self.redis = bus.redis
        self.names = names
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.handler = handler
        self.message_type = message_type
        self.config = config
        self.ack = ack
        self.on_committed = on_committed
        self.max_message_bytes = bus.max_message_bytes if max_message_bytes == -1 else max_message_bytes
        """Entries over this are dead-lettered unread (default: the bus's limit; None: no limit)."""
        self.letter_key = letter_key
        """The run's weights key, to sign this loop's dead letters with (the learner's: a letter about a batch is
        believed only when signed, :mod:`streamrl.common.weights.auth`); None: unsigned."""
        self.stats = ConsumerStats()
        self._committer = CommitBatcher(bus)
        self._tasks: set[asyncio.Task[None]] = set()
        self._holding: dict[asyncio.Task[None], int] = {}
        """Tasks holding in-flight slots (how many: all of them for an entry that runs alone); the
        :meth:`parked` ones hold none."""
        self._held: collections.deque[tuple[str, int]] = collections.deque()
        """Entries pending under this consumer waiting to start (id, deliveries so far): replayed from a
        previous life, or claimed from a dead consumer."""
        self._reserved = 0
        """Slots taken toward the next held entry's start."""
        self._active: set[str] = set()
        """Entries being handled now (a task each)."""
        self._kept: set[str] = set()
        """With ``ack=False``: entries handled and committed that the service acknowledges itself later."""
        self._peers = PeerWatch(config.heartbeat_interval_s)
        self._forget = bus.redis.register_script(FORGET_LUA)
        self._stop: asyncio.Event | None = None
        self.fatal: BaseException | None = None
        """Set when a commit was fenced off (another process holds this service's lease), or an entry's task
        failed outside its handler (:meth:`_fail`): run() raises it."""
        self._slots = asyncio.Semaphore(config.max_in_flight)
        self.keep_alive_s = min(config.claim_interval_s, config.claim_idle_ms / 3000)
        """How often what this consumer holds is marked alive: three times per ``claim_idle_ms`` at
        least, so that another consumer never finds it idle while this one lives, whatever
        ``claim_interval_s`` says (that one paces the look for entries of dead consumers)."""

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def run(self, stop: asyncio.Event, *, burst: bool = False) -> None:
        """Consume until ``stop`` is set (or, with ``burst``, until the stream has nothing left)."""
        self._stop = stop
        await self.ensure_group()
        # First finish, in order, what this consumer name left pending in a previous life; then new
        # entries. Whatever it waits for, the loop comes round every keep_alive_s to keep what it
        # holds from being claimed as idle (and to claim what dead consumers left).
        await self._queue_own_pending()
        next_keep, next_claim = 0.0, time.monotonic() + self.config.claim_interval_s
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_keep:
                await self._keep_alive()
                next_keep = now + self.keep_alive_s
            if now >= next_claim:
                await self._reclaim()
                next_claim = now + self.config.claim_interval_s
            if self._held:
                await self._start_held()
                continue
            _, got = await self._read(stop, start_id=">")
            if burst and got == 0 and not self._tasks and not self._held:
                break
        await self.drain()
        if self.fatal is not None:
            raise self.fatal

    async def drain(self) -> None:
        """Give in-flight entries ``shutdown_grace_s`` to finish, then cancel them (they stay pending).
        What it holds is kept alive meanwhile: no other consumer takes it while this one still works on it."""
        if not self._tasks:
            return
        logger.info("%s: draining %d in-flight entries", self.stream, len(self._tasks))
        deadline = time.monotonic() + self.config.shutdown_grace_s
        pending = set(self._tasks)
        while pending and (left := deadline - time.monotonic()) > 0:
            _, pending = await asyncio.wait(pending, timeout=min(left, self.keep_alive_s))
            if pending:
                await self._keep_alive()
        if pending:
            await cancel_and_wait(pending)
            logger.warning("%s: cancelled %d entries after the grace period", self.stream, len(pending))

    async def _read(self, stop: asyncio.Event, start_id: str) -> tuple[str, int]:
        """Read new entries (``>``): the cursor and how many were read; -1 when no in-flight slot came
        free within block_ms / keep_alive_s.

        With every slot busy (entries waiting for a backend that is down) the caller's loop must still
        come round: to keep the held entries alive, and to see a stop (SIGTERM reaches drain()).
        """
        try:
            async with timeout(min(self.config.block_ms / 1000, self.keep_alive_s)):
                await self._slots.acquire()
        except TimeoutError:
            return start_id, -1
        if stop.is_set():  # stopped while waiting for a free slot (e.g. by a handler): read nothing more
            self._slots.release()
            return start_id, 0
        free = 1
        while free < self.config.count and not self._slots.locked():
            await self._slots.acquire()
            free += 1
        try:
            reply = await self.redis.xreadgroup(
                self.group,
                self.consumer,
                {self.stream: start_id},
                count=free,
                block=min(self.config.block_ms, max(1, int(1000 * self.keep_alive_s))),
            )
        except BaseException:
            for _ in range(free):
                self._slots.release()
            raise
        entries = read_entries(reply)
        for _ in range(free - len(entries)):
            self._slots.release()
        for entry_id, fields in entries:  # new entries: their first delivery
            self._spawn(entry_id, fields, 1)
            start_id = entry_id.decode()
        return start_id, len(entries)

    async def _queue_own_pending(self) -> None:
        """Queue, in order, the entries this consumer name holds from a previous life (they start as
        slots allow: :meth:`_start_held`)."""
        start = "-"
        while True:
            page = await self.redis.xpending_range(
                self.stream, self.group, min=start, max="+", count=256, consumername=self.consumer
            )
            rows = pending(page)
            self._held.extend(rows)
            if len(rows) < 256:
                return
            start = "(" + rows[-1].entry_id

    async def _start_held(self) -> None:
        """Start the first entry of ``_held`` (pending under this consumer, delivered ``prior`` times).

        Its delivery is counted now, as it starts (XCLAIM to itself), not when it was queued: an
        entry waiting here when the process dies is not blamed for it. An entry on its last allowed
        delivery (``max_deliveries``, after at least one that never finished) runs **alone**: it
        takes every in-flight slot, so if it kills the process again no innocent entry running beside
        it is charged a delivery - it is the one dead-lettered, before its handler runs, the next time
        (:meth:`_handle`: "killed its consumer N times").
        """
        entry_id, prior = self._held[0]
        upcoming = prior + 1
        alone = upcoming == self.config.max_deliveries and upcoming > 1
        wanted = self.config.max_in_flight if alone else 1
        if not await self._reserve(wanted):
            return  # the loop comes round (keep-alive, stop) and tries again
        self._held.popleft()
        reserved, self._reserved = self._reserved, 0
        claimed = entries_of(await self.redis.xclaim(self.stream, self.group, self.consumer, 0, [entry_id]))
        if not claimed or not claimed[0][1]:  # acknowledged meanwhile, or trimmed from the stream
            for _ in range(reserved):
                self._slots.release()
            if claimed:
                await self._drop_trimmed(entry_id)
            return
        if alone:
            logger.warning(
                "%s %s: delivery %d of %d after deliveries that never finished: handled alone",
                self.stream,
                entry_id,
                upcoming,
                self.config.max_deliveries,
            )
        self._spawn(claimed[0][0], claimed[0][1], upcoming, slots=reserved)

    async def _reserve(self, wanted: int) -> bool:
        """Hold ``wanted`` in-flight slots (``_reserved`` keeps what is held so far), waiting at most
        block_ms / keep_alive_s: True once all are held."""
        try:
            async with timeout(min(self.config.block_ms / 1000, self.keep_alive_s)):
                while self._reserved < wanted:
                    await self._slots.acquire()
                    self._reserved += 1
        except TimeoutError:
            return False
        return True

    async def _drop_trimmed(self, entry_id: str) -> None:
        await self.redis.xack(self.stream, self.group, entry_id)
        logger.warning(
            "%s %s was trimmed from the stream before it was handled: acknowledged, its work is "
            "lost (redis.maxlen too small?)",
            self.stream,
            entry_id,
        )

    def _spawn(self, entry_id: bytes | str, fields: dict[bytes, bytes] | None, deliveries: int, slots: int = 1) -> None:
        """Handle an entry in a task that holds ``slots`` in-flight slots (all of them: it runs alone)."""
        entry = text(entry_id)
        task = asyncio.create_task(self._process(entry, fields, deliveries))
        self._tasks.add(task)
        self._active.add(entry)
        self._holding[task] = slots
        self.stats.in_flight = len(self._tasks)

        def _done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self._active.discard(entry)
            for _ in range(self._holding.pop(t, 0)):
                self._slots.release()
            self.stats.in_flight = len(self._tasks)
            if not t.cancelled() and (error := t.exception()) is not None:
                self._fail(entry, error)

        task.add_done_callback(_done)

    def _fail(self, entry_id: str, error: BaseException) -> None:
        """An entry's task raised past the handler's boundary: its dead letter or its retry could not be
        written (Redis refused or stayed away past ``redis.outage_s``), or a bug. Like a failure of the loop's
        own commands, it stops the loop: :meth:`run` raises it (the process exits non-zero for its
        orchestrator to restart), and the entry stays pending under this consumer for its next life."""
        logger.error(
            "%s %s: handling failed outside the handler; stopping: %r", self.stream, entry_id, error, exc_info=error
        )
        self.stats.last_error = f"{type(error).__name__}: {error}"
        if self.fatal is None:
            self.fatal = error
        if self._stop is not None:
            self._stop.set()

    async def _keep_alive(self) -> None:
        """Reset the idle time of every entry pending under this (live) consumer's name, and queue the
        ones it does not know of.

        Those it knows are being handled now (a long generation, a prompt waiting for its weights),
        waiting to start, or held on purpose (``ack=False``). Without this, work slower than
        claim_idle_ms would be claimed again while it runs and could reach max_deliveries. JUSTID: no
        delivery is counted. An entry pending under this name that it does not know of was delivered
        by a read whose reply never arrived (the connection dropped after Redis ran the XREADGROUP; the
        client's retry read the next entries): it is queued to start like an entry of a previous life,
        instead of being kept alive for ever, unhandled.
        """
        known = self._active | self._kept | {entry_id for entry_id, _ in self._held}
        seen: set[str] = set()
        start = "-"
        while True:
            held = pending(
                await self.redis.xpending_range(
                    self.stream, self.group, min=start, max="+", count=256, consumername=self.consumer
                )
            )
            if not held:
                break
            ids: list[StreamIdT] = [row.entry_id for row in held]
            seen.update(row.entry_id for row in held)
            orphans = [row for row in held if row.entry_id not in known]
            if orphans:
                logger.warning(
                    "%s: %d entries pending under %s that it never received (a lost reply): queued",
                    self.stream,
                    len(orphans),
                    self.consumer,
                )
                self._held.extend(orphans)
            await self.redis.xclaim(self.stream, self.group, self.consumer, 0, ids, justid=True)
            if len(held) < 256:
                break
            start = "(" + held[-1].entry_id
        self._kept &= seen

    async def _reclaim(self) -> None:
        """Take over what dead consumers left pending - at once for a consumer whose instance stopped
        heartbeating, otherwise entries idle longer than claim_idle_ms - and trim the stream to what
        its groups still need (:mod:`streamrl.common.trim`). A consumer with no free slot could take nothing: it
        leaves both looks to one with room (in a busy fleet, most are full: W consumers judging W - 1 peers each
        round cost Redis W(W - 1) heartbeat lookups)."""
        if self._free_slots() - len(self._held) > 0:
            await self._reclaim_from_the_dead()
        if (free := self._free_slots() - len(self._held)) > 0:
            idle = await self.redis.xpending_range(
                self.stream, self.group, min="-", max="+", count=min(32, free), idle=self.config.claim_idle_ms
            )
            ids: list[StreamIdT] = [row.entry_id for row in pending(idle)]
            if ids:  # JUSTID: no delivery counted until an entry starts; min idle again: one claimer wins
                claimed = entry_ids(
                    await self.redis.xclaim(
                        self.stream, self.group, self.consumer, self.config.claim_idle_ms, ids, justid=True
                    )
                )
                await self._report_trimmed({str(i) for i in ids} - set(claimed))
                await self._take(claimed)
        try:
            await trim_consumed(self.redis, self.stream, self.bus.retain_consumed_s)
        except ResponseError as e:  # an ACL without XTRIM / XINFO: the stream is bounded by maxlen alone
            logger.debug("%s: not trimmed: %s", self.stream, e)

    async def _report_trimmed(self, not_claimed: set[str]) -> None:
        """Of the idle entries a claim did not return, those gone from the stream were trimmed before they
        were handled (Redis drops them from the pending list as it claims): say so, their work is lost.
        The others were taken by another consumer first."""
        for entry_id in sorted(not_claimed):
            if not await self.redis.xrange(self.stream, entry_id, entry_id):
                logger.warning(
                    "%s %s was trimmed from the stream before it was handled: acknowledged, its work is lost "
                    "(redis.maxlen too small?)",
                    self.stream,
                    entry_id,
                )

    async def _take(self, ids: list[str]) -> None:
        """Queue entries just claimed (JUSTID: no delivery counted yet) to start as slots allow."""
        if not ids:
            return
        rows = await self.redis.xpending_range(
            self.stream, self.group, min=ids[0], max=ids[-1], count=len(ids) + 64, consumername=self.consumer
        )
        counts = dict(pending(rows))
        self.stats.reclaimed += len(ids)
        self._held.extend((i, counts.get(i, 1)) for i in ids)

    async def _reclaim_from_the_dead(self) -> None:
        """Claim the pending entries of consumers named after an instance whose heartbeat is gone.

        Only consumers registered as an instance (``{service}:{name}`` in the instances set) are
        judged (:mod:`streamrl.common.peers`: not right after an outage, missing on two looks, one
        pipelined EXISTS); others wait for claim_idle_ms. The claim needs the entries idle for one
        heartbeat interval, so two live consumers never both take them (the first claim resets the
        idle time). A dead consumer left with nothing is deleted atomically with the check.
        """
        ttl_s = 2 * self.config.heartbeat_interval_s
        if not may_judge(OutageRetry.healthy_for(), ttl_s):
            self._peers.missing_since.clear()  # looks from before the outage do not count
            return
        consumers = await self.redis.xinfo_consumers(self.stream, self.group)
        others = [text(c["name"]) for c in consumers if text(c["name"]) != self.consumer]
        if not others:
            return
        members = [text(m).split(":", 1) for m in await self.redis.smembers(self.names.instances)]
        keys = {name: [self.names.heartbeat(s, i) for s, i in members if i == name] for name in others}
        candidates = [name for name in others if keys[name]]
        pipe = self.redis.pipeline(transaction=False)
        for name in candidates:
            pipe.exists(*keys[name])
        alive = dict(zip(candidates, await pipe.execute(), strict=True)) if candidates else {}
        dead = self._peers.look(
            {n for n in candidates if not alive[n]}, {n for n in candidates if alive[n]}, time.monotonic()
        )
        holding = {text(c["name"]): int(c["pending"]) for c in consumers}
        for name in sorted(dead):
            if holding[name]:  # (one that holds nothing - its entries taken after claim_idle_ms - is just forgotten)
                if (free := self._free_slots() - len(self._held)) <= 0:
                    return  # no room: the rest is taken at a later round (or by a consumer with room)
                held = await self.redis.xpending_range(
                    self.stream, self.group, min="-", max="+", count=free, consumername=name
                )
                min_idle_ms = int(1000 * self.config.heartbeat_interval_s)
                ids = [row.entry_id for row in pending(held)]
                claimed = []
                if ids:  # none when another consumer took them since XINFO counted them (XCLAIM refuses [])
                    claimed = entry_ids(
                        await self.redis.xclaim(
                            self.stream, self.group, self.consumer, min_idle_ms, [*ids], justid=True
                        )
                    )
                if claimed:
                    logger.info(
                        "%s: took over %d entries of %s (its heartbeat stopped)", self.stream, len(claimed), name
                    )
                await self._take(claimed)
            member_of = [f"{s}:{i}" for s, i in members if i == name]
            if await self._forget(
                keys=[self.stream, self.names.instances, *keys[name]], args=[self.group, name, *member_of]
            ):
                self._peers.forget(name)

    def _free_slots(self) -> int:
        """In-flight slots free now (claims take no more: claimed entries wait for few slots)."""
        return self.config.max_in_flight - sum(self._holding.values()) - self._reserved

    @contextlib.asynccontextmanager
    async def parked(self) -> AsyncIterator[None]:
        """For a handler that waits for something other than its own work (a prompt for weights not yet
        served): inside, its entry gives its in-flight slot back, so entries that can run now are still
        read however many wait; on the way out it takes a slot again (waiting its turn) before it goes
        on. The entry stays pending under this consumer, kept alive. Outside this loop's tasks: a no-op."""
        task = asyncio.current_task()
        if task not in self._holding:
            yield
            return
        slots = self._holding.pop(task)
        for _ in range(slots):
            self._slots.release()
        try:
            yield
        finally:
            taken = 0
            try:
                while taken < slots:
                    await self._slots.acquire()
                    taken += 1
            finally:  # cancelled here: the task holds what it took, _done releases that
                self._holding[task] = taken

    async def _delivery_count(self, entry_id: bytes | str) -> int:
        info = await self.redis.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        return pending(info)[0].delivered if info else 1

    async def _process(self, entry_id: str, fields: dict[bytes, bytes] | None, deliveries: int) -> None:
        try:
            await self._handle(entry_id, fields, deliveries)
        except LeaseLostError as e:  # fenced off: this process must stop, not retry (or dead-letter) the entry
            if self.fatal is None:
                logger.error("%s %s: %s; stopping", self.stream, entry_id, e)
                self.fatal = e
            if self._stop is not None:
                self._stop.set()

    async def _handle(self, entry_id: str, fields: dict[bytes, bytes] | None, deliveries: int) -> None:
        payload = (fields or {}).get(PAYLOAD_FIELD, b"")
        if deliveries > self.config.max_deliveries:  # every earlier delivery ended with its consumer dead
            reason = (
                f"killed its consumer {deliveries - 1} times (delivered {deliveries} times, max_deliveries "
                f"{self.config.max_deliveries}): the process handling it died (OOM, segfault, SIGKILL?)"
            )
            logger.error("%s %s %s", self.stream, entry_id, reason)
            await self._dead_letter(entry_id, payload, reason, deliveries)
            return
        if self.max_message_bytes is not None and len(payload) > self.max_message_bytes:
            reason = (
                f"MessageTooLargeError: entry of {len(payload) / 2**20:.1f} MiB is over the "
                f"{self.max_message_bytes / 2**20:.1f} MiB limit (redis.max_message_mb); payload cut to 64 KiB"
            )
            await self._dead_letter(entry_id, payload[:DEAD_PAYLOAD_CUT], reason, deliveries)
            return
        try:
            message: M = decode(payload, self.message_type)
        except PoisonMessageError as e:
            await self._dead_letter(entry_id, payload, f"PoisonMessageError: {e}", deliveries)
            return
        while True:
            started = time.perf_counter()
            set_delivery_attempt(deliveries)  # a span the handler starts records which delivery it is
            _CURRENT_ENTRY.set(entry_id)
            try:
                outputs = await self.handler(message)
                fresh = await self._committer.commit(
                    outputs, ack_stream=self.stream, ack_group=self.group, ack_entry=entry_id, ack=self.ack
                )
            except (asyncio.CancelledError, LeaseLostError):
                raise
            except PoisonMessageError as e:
                await self._dead_letter(entry_id, payload, f"PoisonMessageError: {e}", deliveries)
                return
            except Exception as e:  # noqa: BLE001 - the worker boundary: every handler failure is counted and retried
                reason = redact_url(f"{type(e).__name__}: {e}")  # logged, in the heartbeat, in the dead letter
                self.stats.failed += 1
                self.stats.last_error = reason
                if deliveries >= self.config.max_deliveries:
                    logger.error("%s %s failed %d times, dead-lettering: %s", self.stream, entry_id, deliveries, reason)
                    await self._dead_letter(entry_id, payload, reason, deliveries)
                    return
                logger.warning("%s %s failed (delivery %d): %s", self.stream, entry_id, deliveries, reason)
                await asyncio.sleep(e.defer_s if isinstance(e, RetryableError) else self.config.retry_delay_s)
                claimed = entries_of(await self.redis.xclaim(self.stream, self.group, self.consumer, 0, [entry_id]))
                if not claimed or not claimed[0][1]:
                    return  # acked or trimmed meanwhile
                self.stats.retried += 1
                deliveries = await self._delivery_count(entry_id)
                continue
            await self._after_commit(entry_id, message)
            elapsed = time.perf_counter() - started
            self.stats.processed += 1
            if not fresh:
                self.stats.skipped_duplicates += 1
            self.stats.durations_s.append(elapsed)
            del self.stats.durations_s[:-1000]
            logger.debug("%s %s handled in %.1f ms", self.stream, entry_id, elapsed * 1e3)
            return

    async def _after_commit(self, entry_id: str, message: M) -> None:
        if not self.ack:  # pending until the service acknowledges it: kept alive meanwhile
            self._kept.add(entry_id)
        if self.on_committed is not None:
            await self.on_committed(entry_id, message)

    async def _dead_letter(self, entry_id: str, payload: bytes, reason: str, deliveries: int) -> None:
        if len(payload) > DEAD_PAYLOAD_CUT and len(payload) > self.bus.max_message_bytes // 2:  # the letter must fit
            payload, reason = payload[:DEAD_PAYLOAD_CUT], f"{reason} (payload cut to 64 KiB)"
        letter = DeadLetter(
            stream=self.stream,
            entry_id=entry_id,
            group=self.group,
            consumer=self.consumer,
            error=redact_url(reason),
            deliveries=deliveries,
            payload=payload,
            ts=time.time(),
        )
        letter = sign(letter, self.letter_key, run_id=home_run_id(self.names.run_id))
        await self.bus.commit(
            [Output(stream=self.names.dead, message=letter)],
            ack_stream=self.stream,
            ack_group=self.group,
            ack_entry=entry_id,
        )
        self.stats.dead_lettered += 1
        logger.error("dead-lettered %s %s: %s", self.stream, entry_id, reason)


def encode_payload(message: Message) -> dict[bytes, bytes]:
    """Stream entry fields for ``message`` (for tests and tools that XADD directly)."""
    return {PAYLOAD_FIELD: encode(message)}
