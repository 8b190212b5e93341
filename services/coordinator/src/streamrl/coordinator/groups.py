"""The group buffer: training prompt groups from issue to batch, kept in Redis.

A group (the ``group_size`` samples answering one prompt) moves through::

    issued      in ``inflight``, with the version it requires and its issue time (``inflight_info``),
                written in the same transaction as its prompt (``issuing.py``)
    collecting  its scored records land in the hash ``groups:{id}`` (written by the scored consumer); each
                names its payload (``payload:{trajectory id}:{attempt}``, written once by the rollout worker)
    complete    every sample in: to ``ready`` (counted in ``accepted``), or dropped by dynamic filtering
    failed      a member was dead-lettered, or the group outlived ``group_timeout_s``: buffer and payloads deleted
    batched     taken into a training batch (``batches.py``): its records go into the batch's manifest, its buffer
                is deleted and each payload renamed ``batched:{batch}:{trajectory id}``, where the learner reads
                it; deleted once the batch is trained and checkpointed (by the learner) or counted dead (by the
                coordinator)

A group that leaves without reaching ``ready`` (filtered or failed) pushes the version it required
onto ``owed_versions``, and its replacement takes that version (``admission.py`` says why). Every
transition out of ``inflight`` is one server-side script that first removes the group from it, so
it happens once even when two paths race (a dead letter and a timeout), and the script is fenced and
run once against a re-send (``scripts.py``). Samples that arrive for a group neither in flight nor
ready (the other members of a failed group) are deleted with their payloads and counted, never left in
Redis. Every drop deletes the payloads its records name in the same script or transaction
(:data:`streamrl.common.payloads.DROP_PAYLOADS_LUA`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from streamrl.common.codec import decode
from streamrl.common.messages import ScoredRecord
from streamrl.common.payloads import DROP_PAYLOADS_LUA
from streamrl.common.replies import text
from streamrl.common.tx import Tx
from streamrl.coordinator import state as st
from streamrl.coordinator.filtering import has_spread
from streamrl.coordinator.scripts import FencedScript
from streamrl.coordinator.state import RunState

logger = logging.getLogger(__name__)

LEAVE_LUA = (
    DROP_PAYLOADS_LUA
    + """
if redis.call('SREM', KEYS[1], ARGV[1]) == 0 then return 0 end
local info = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if ARGV[2] == 'ready' then
  redis.call('RPUSH', KEYS[3], ARGV[1]); redis.call('INCR', KEYS[4])
else
  drop_payloads(KEYS[5], ARGV[3])
  redis.call('DEL', KEYS[5]); redis.call('INCR', KEYS[6])
  if info then redis.call('RPUSH', KEYS[7], string.match(info, '^(-?%d+)@')) end
end
return 1
"""
)
"""A group leaves ``inflight`` once: to ``ready`` (ARGV[2] = 'ready'), or dropped (buffer and payloads deleted),
its required version owed. KEYS: inflight, inflight_info, ready, accepted, its buffer, the drop counter,
owed_versions; ARGV: group, 'ready' or 'drop', the run's payload key prefix."""
DROP_LATE_LUA = (
    DROP_PAYLOADS_LUA
    + """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('LPOS', KEYS[2], ARGV[1]) then return 0 end
local n = redis.call('HLEN', KEYS[3])
if n > 0 then drop_payloads(KEYS[3], ARGV[2]); redis.call('DEL', KEYS[3]); redis.call('INCRBY', KEYS[4], n) end
return n
"""
)
"""Delete the buffer (and the payloads its records name) of a group neither in flight nor ready; returns the
samples dropped. KEYS: inflight, ready, its buffer, late_samples_dropped; ARGV: group, payload key prefix."""


@dataclass(frozen=True)
class InFlight:
    """What is recorded of an in-flight group when it is issued."""

    required_version: int
    """The policy version its prompt asks for."""
    issued_at: float
    """Unix time (s) of issue."""

    def encode(self) -> str:
        return f"{self.required_version}@{self.issued_at:.3f}"

    @classmethod
    def parse(cls, raw: bytes | str) -> InFlight:
        version, _, issued_at = (raw.decode() if isinstance(raw, bytes) else raw).partition("@")
        return cls(int(version), float(issued_at))


def overdue(
    groups: dict[str, InFlight], *, version: int, version_seen_at: dict[int, float], now: float, timeout_s: float
) -> list[str]:
    """The groups past their timeout (pure). A group's clock starts when it could start: at issue,
    or when the version it requires was published if that came later. A group still waiting for its
    version (prefetched) is never overdue: its wait is the learner's time, not lost work."""
    out = []
    for group, info in groups.items():
        if info.required_version > version:
            continue
        started = max(info.issued_at, version_seen_at.get(info.required_version, 0.0))
        if now - started > timeout_s:
            out.append(group)
    return out


@dataclass(frozen=True)
class Checked:
    """What :meth:`GroupBuffer.complete` found."""

    left: int
    """Groups that left the in-flight set (moved to ``ready``, or dropped by dynamic filtering)."""
    gone: list[str]
    """Candidates that were not in flight when checked (batched, dropped or failed): only their buffers can hold
    late samples (:meth:`GroupBuffer.drop_late`)."""


class GroupBuffer:
    """The in-flight and ready groups of one run (see the module docstring)."""

    def __init__(self, state: RunState, *, group_size: int, dynamic_filtering: bool) -> None:
        self.state = state
        self.redis = state.redis
        self.group_size = group_size
        self.dynamic_filtering = dynamic_filtering
        self._leave = FencedScript(state.bus, LEAVE_LUA, "groups.LEAVE_LUA")
        self._drop_late = FencedScript(state.bus, DROP_LATE_LUA, "groups.DROP_LATE_LUA", once=False)

    def buffer(self, group: str) -> str:
        return self.state.names.group_buffer(group)

    @property
    def prefix(self) -> str:
        """The run's payload key prefix: the only keys a record may name (and a drop delete)."""
        return self.state.names.payload_prefix

    # -- issue -----------------------------------------------------------------------------------
    def queue_issue(self, tx: Tx, group: str, required_version: int, issued_at: float) -> None:
        """Add to ``tx`` (the transaction that XADDs the prompt): ``group`` is in flight."""
        tx.sadd(self.state.key(st.INFLIGHT), group)
        tx.hset(self.state.key(st.INFLIGHT_INFO), group, InFlight(required_version, issued_at).encode())

    async def in_flight(self) -> int:
        return int(await self.redis.scard(self.state.key(st.INFLIGHT)))

    async def owed(self) -> list[int]:
        """Versions owed to replacements (the required versions of lost groups)."""
        return [int(v) for v in await self.redis.lrange(self.state.key(st.OWED_VERSIONS), 0, -1)]

    async def coming_versions(self) -> list[int]:
        """The versions required by the groups in flight and owed to replacements not issued yet: the groups still
        to complete, each by the lowest version it can be generated at (one round trip)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hvals(self.state.key(st.INFLIGHT_INFO))
        pipe.lrange(self.state.key(st.OWED_VERSIONS), 0, -1)
        info, owed = await pipe.execute()
        return [InFlight.parse(v).required_version for v in info] + [int(v) for v in owed]

    def queue_repay(self, tx: Tx, versions: Iterable[int]) -> None:
        """Add to ``tx``: these owed versions were given to replacements."""
        for v in versions:
            tx.lrem(self.state.key(st.OWED_VERSIONS), 1, v)

    async def adopt_untracked(self, version: int, now: float) -> int:
        """Record groups in flight with no ``inflight_info`` (issued by an older coordinator) as
        requiring the current ``version``, issued ``now``. A version too low is harmless (the group
        is too stale at batching and replaced again); one too high could deadlock."""
        groups = {text(g) for g in await self.redis.smembers(self.state.key(st.INFLIGHT))}
        known = {text(g) for g in await self.redis.hkeys(self.state.key(st.INFLIGHT_INFO))}
        if groups - known:
            tx = self.state.tx()
            for group in groups - known:
                tx.call("HSETNX", self.state.key(st.INFLIGHT_INFO), group, InFlight(version, now).encode())
            await tx.execute()
            logger.info(
                "recorded %d in-flight groups of an older coordinator as requiring version %d",
                len(groups - known),
                version,
            )
        return len(groups - known)

    # -- complete, fail, time out ----------------------------------------------------------------
    def _leave_keys(self, group: str, counter: str) -> list[str]:
        k = self.state.key
        return [
            k(st.INFLIGHT),
            k(st.INFLIGHT_INFO),
            k(st.READY),
            k(st.ACCEPTED),
            self.buffer(group),
            k(counter),
            k(st.OWED_VERSIONS),
        ]

    async def complete(self, candidates: Iterable[str] | None) -> Checked:
        """Move complete groups to ``ready`` (or drop them: dynamic filtering). Only ``candidates``
        are checked, or every in-flight group when None."""
        if candidates is None:
            groups = [text(g) for g in await self.redis.smembers(self.state.key(st.INFLIGHT))]
        else:
            groups = list(candidates)
        if not groups:
            return Checked(0, [])
        pipe = self.redis.pipeline(transaction=False)
        for g in groups:
            pipe.hlen(self.buffer(g))
            pipe.sismember(self.state.key(st.INFLIGHT), g)
        replies = await pipe.execute()
        complete = [
            g
            for g, size, in_flight in zip(groups, replies[::2], replies[1::2], strict=True)
            if size >= self.group_size and in_flight
        ]
        gone = [g for g, in_flight in zip(groups, replies[1::2], strict=True) if not in_flight]
        if not complete:
            return Checked(0, gone)
        members = await self.samples(complete) if self.dynamic_filtering else {}
        pipe = self.redis.pipeline(transaction=False)
        for group in complete:
            keep = has_spread([s.score for s in members[group]]) if self.dynamic_filtering else True
            await self._leave.queue(
                pipe, self._leave_keys(group, st.GROUPS_FILTERED), [group, "ready" if keep else "drop", self.prefix]
            )
        return Checked(sum(1 for left in await self._leave.replies(pipe) if left), gone)

    async def fail(self, group: str, counter: str) -> bool:
        """Fail an in-flight group (its buffer deleted, its version owed, ``counter`` incremented);
        False when it was not in flight (already complete, failed or batched)."""
        return bool(await self._leave(self._leave_keys(group, counter), [group, "drop", self.prefix]))

    async def version_published(self, version: int, at: float) -> None:
        """Note when ``version`` was first seen: the clock of the groups requiring it starts there."""
        await self.state.tx().call("HSETNX", self.state.key(st.VERSION_SEEN_AT), str(version), f"{at:.3f}").execute()

    async def time_out(self, *, version: int, now: float, timeout_s: float) -> list[str]:
        """Fail the groups past ``timeout_s`` (one warning line each); returns them."""
        raw = await self.redis.hgetall(self.state.key(st.INFLIGHT_INFO))
        groups = {text(g): InFlight.parse(v) for g, v in raw.items()}
        seen = {int(v): float(t) for v, t in (await self.redis.hgetall(self.state.key(st.VERSION_SEEN_AT))).items()}
        failed = []
        for group in overdue(groups, version=version, version_seen_at=seen, now=now, timeout_s=timeout_s):
            if await self.fail(group, st.GROUPS_TIMED_OUT):
                info = groups[group]
                logger.warning(
                    "group %s timed out: issued %.0f s ago for version %d, not complete after "
                    "group_timeout_s=%.0f s; a replacement prompt will be issued",
                    group,
                    now - info.issued_at,
                    info.required_version,
                    timeout_s,
                )
                failed.append(group)
        return failed

    async def drop_late(self, groups: Iterable[str]) -> int:
        """Delete the samples stored for groups no longer in flight nor ready; returns how many."""
        groups = list(groups)
        if not groups:
            return 0
        k = self.state.key
        pipe = self.redis.pipeline(transaction=False)
        for group in groups:
            keys = [k(st.INFLIGHT), k(st.READY), self.buffer(group), k(st.LATE_SAMPLES_DROPPED)]
            await self._drop_late.queue(pipe, keys, [group, self.prefix])
        counts = await self._drop_late.replies(pipe)
        for group, n in zip(groups, counts, strict=True):
            if n:
                logger.info("dropped %d late samples of group %s (no longer in flight)", n, group)
        return sum(counts)

    # -- ready groups ----------------------------------------------------------------------------
    async def ready(self) -> list[str]:
        return [text(g) for g in await self.redis.lrange(self.state.key(st.READY), 0, -1)]

    async def stored(self, groups: list[str]) -> dict[str, list[tuple[ScoredRecord, int]]]:
        """The stored records of each group with their encoded sizes (bytes), in sample order (one round trip)."""
        pipe = self.redis.pipeline(transaction=False)
        for group in groups:
            pipe.hgetall(self.buffer(group))
        out = {}
        for group, raw in zip(groups, await pipe.execute(), strict=True):
            samples = [(decode(v, ScoredRecord), len(v)) for v in raw.values()]
            out[group] = sorted(samples, key=lambda s: s[0].trajectory.group_index)
        return out

    async def samples(self, groups: list[str]) -> dict[str, list[ScoredRecord]]:
        """The stored samples of each group (one round trip), in sample order."""
        return {g: [s for s, _ in stored] for g, stored in (await self.stored(groups)).items()}

    def batched(self, batch_id: str, trajectory_id: str) -> str:
        """Where the payload of a sample in batch ``batch_id`` is kept for the learner (its payload key, renamed)."""
        return self.state.names.batched_payload(batch_id, trajectory_id)

    def queue_batched(self, tx: Tx, members: dict[str, list[ScoredRecord]], batch_id: str) -> None:
        """Add to ``tx`` (the transaction that XADDs the batch's manifest), before its other writes: these ready
        groups (with their records) go into batch ``batch_id``. Each payload is renamed to :meth:`batched` (a late
        copy of a sample then names another payload, dropped as late, never one the batch names) and the buffers
        are deleted (the manifest carries the records); the learner reads the payloads there and deletes them
        once the batch is trained and checkpointed (or the coordinator, when the batch is counted dead:
        ``batches.py``)."""
        for records in members.values():
            for r in records:
                tx.rename(r.trajectory.payload_key, self.batched(batch_id, r.trajectory.id))
        for group in members:
            tx.delete(self.buffer(group))
            tx.lrem(self.state.key(st.READY), 1, group)

    def queue_drop_ready(self, tx: Tx, members: dict[str, list[ScoredRecord]], owed_version: int) -> None:
        """Add to ``tx``: drop these ready groups (buffers and payloads deleted); their replacements are owed
        ``owed_version``."""
        groups = list(members)
        for group in groups:
            tx.lrem(self.state.key(st.READY), 1, group)
            tx.delete(self.buffer(group), *(r.trajectory.payload_key for r in members[group]))
        tx.call("DECRBY", self.state.key(st.ACCEPTED), len(groups))
        for _ in groups:
            tx.rpush(self.state.key(st.OWED_VERSIONS), owed_version)
