"""The coordinator's run state: every key it keeps under ``streamrl:{run}:state:``, named in one place.

All progress of a run lives in Redis, none in the process, so a coordinator killed at any point and
restarted continues where it stopped. The names below are the stored layout; a coordinator reads the
state an older one wrote (keys it adds are created as it goes, see ``GroupBuffer.adopt_untracked``).

Every write the coordinator makes is **fenced** (it writes nothing once another process holds the
coordinator's lease: ``Bus.fence``) and **runs once** however often the client re-sends it after a
lost reply: a :meth:`RunState.tx` transaction (:mod:`streamrl.common.tx`: a ``once`` key returns the
first execution's replies) or a :class:`~streamrl.coordinator.scripts.FencedScript` (the same, for
the scripts whose condition a ``require`` cannot say). What makes each one right when it runs again
anyway - a restarted coordinator redoing a step it had half done, a follower re-reading its last
entries - is in the last column. The write points (the fault suite drops the reply of each in turn):

=======================  ==========================  ===================================  =============================
write point              where                       what it writes                       when run again
=======================  ==========================  ===================================  =============================
scored commit            consumer loop (``bus``)     sample into ``groups:{g}``, XACK     only while the entry is pending
issue prompts            ``issuing`` Tx              XADD prompts, ``inflight(_info)``,   ``require(cursor == c)``; ids
                                                     LREM owed, SET cursor = c + n,       ``p{c+i}`` from the cursor
                                                     prompts_too_large/bad counters
group leaves inflight    ``groups.LEAVE_LUA``        to ``ready`` + accepted, or dropped  SREM from ``inflight`` first:
                                                     (buffer DEL, counter, owed version)  a second run finds it gone
late samples dropped     ``groups.DROP_LATE_LUA``    DEL buffer, late_samples_dropped     buffer already empty
adopt untracked groups   ``groups`` Tx               HSETNX inflight_info                 HSETNX
version first seen       ``groups`` Tx               HSETNX version_seen_at               HSETNX
too-stale drop           ``batches`` Tx              LREM ready, DEL buffers, DECRBY      ``require(batch_index == k)``
                                                     accepted, RPUSH owed, counter
publish batch ``k``      ``batches`` Tx              XADD batches (id ``batch-{k}``),     ``require(batch_index == k)``,
                                                     RENAME payloads, LREM ready, DEL     then SET k + 1: no duplicate,
                                                     buffers, SET batch_index = k + 1     no gap
big batch ``k``          ``batches`` Txs             SET building, then pieces of at      ``require(batch_index == k)``;
(in pieces)                                          most ``batch_tx_samples``: RENAME    a piece moves groups out of
                                                     payloads, LREM ready, DEL buffers;   ``ready``: a restart moves
                                                     last XADD, SET k + 1, DEL building   those still there, publishes
dead batch counted       ``batches.DEAD_BATCH_LUA``  SADD dead_batch_ids, counters        SADD of its id first
refused batch re-sent    ``batches.RESEND_LUA``      HINCRBY batch_resends, XADD batches  bounded by the count; none
                                                                                          once counted dead
policy version           ``service`` Tx              SET policy_version                   the same value (increasing)
dead-letter counters     ``service.COUNT_LETTER``    INCR dead_letters (+ reward's), SET  only for an entry id above
                                                     dead_counted                         ``dead_counted``
tail cursors             ``followers`` Tx            SET weights_cursor / dead_cursor     the same value (a re-read is
                                                                                          handled by the guards above)
progress                 ``progress`` Tx             HSET progress                        the same values
eval round start         ``evaluation.START_ROUND``  HSETNX eval_rounds, XADD prompts,    HSETNX of the round first
                                                     SADD eval_dead (skipped prompts)
eval prompt dead         ``evaluation.RECORD_DEAD``  SADD eval_dead:{v} (open rounds)     SADD
eval late answers        ``evaluation.DROP_LATE``    DEL round buffer, counter            buffer already empty
eval round close         ``evaluation`` Tx           HSET eval_rounds, DEL buffer and     read as closed afterwards
                                                     eval_dead, eval counters
=======================  ==========================  ===================================  =============================
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from streamrl.common.bus import Bus
from streamrl.common.replies import raw
from streamrl.common.streams import StreamNames
from streamrl.common.tx import Tx

# -- the policy version and the followed streams
POLICY_VERSION = "policy_version"
"""int: newest version the learner published (never decreases)."""
VERSION_SEEN_AT = "version_seen_at"
"""hash version -> unix time the coordinator first saw it (a group's timeout clock starts there)."""
WEIGHTS_CURSOR = "weights_cursor"
"""Last ``weights`` entry handled."""
DEAD_CURSOR = "dead_cursor"
"""Last ``dead`` entry handled."""
DEAD_COUNTED = "dead_counted"
"""Last ``dead`` entry counted in ``dead_letters`` (a letter read again after a restart is not counted again)."""

# -- prompt groups, from issue to batch
CURSOR = "cursor"
"""int: dataset position of the next training prompt."""
INFLIGHT = "inflight"
"""set: training groups issued, not yet complete or failed."""
INFLIGHT_INFO = "inflight_info"
"""hash group -> ``{required_version}@{issued_at}`` of each group in ``inflight``."""
OWED_VERSIONS = "owed_versions"
"""list: the required version of each group lost before it was accepted, for its replacement."""
READY = "ready"
"""list: complete, kept groups waiting for a batch, in completion order."""
ACCEPTED = "accepted"
"""int: groups batched or ready (admission counts them)."""
BATCH_INDEX = "batch_index"
"""int: index of the next batch."""
BUILDING = "building"
"""msgpack: the batch being moved under its id in pieces (``batches.Building``), while it is; absent otherwise."""
DEAD_BATCH_IDS = "dead_batch_ids"
"""set: batches the learner dead-lettered (each counted once)."""
BATCH_RESENDS = "batch_resends"
"""hash batch id -> times a batch the learner refused unconsumed was sent again."""

# -- evaluation
EVAL_ROUNDS = "eval_rounds"
"""hash version -> ``started@{unix time}`` while open, then its accuracy (or ``none``: no answer came)."""


def eval_dead(version: int) -> str:
    """set: the prompts of evaluation round ``version`` that were dead-lettered."""
    return f"eval_dead:{version}"


PROGRESS = "progress"
"""hash: what the launcher shows (``streamrl up``)."""

# -- counters (int), shown in the progress hash and each batch's metrics once non-zero
GROUPS_DEAD = "groups_dead"
"""Groups failed because a member was dead-lettered."""
GROUPS_TIMED_OUT = "groups_timed_out"
"""Groups failed after coordinator.group_timeout_s."""
GROUPS_FILTERED = "groups_filtered"
"""Groups dropped by dynamic filtering."""
SAMPLES_TOO_STALE = "samples_too_stale"
"""Samples dropped at batching as over max_staleness."""
LATE_SAMPLES_DROPPED = "late_samples_dropped"
"""Samples that arrived for a group or evaluation round already failed or closed."""
PROMPTS_TOO_LARGE = "prompts_too_large"
"""Dataset prompts skipped as over redis.max_message_mb."""
PROMPTS_BAD = "prompts_bad"
"""Dataset rows skipped as unusable (a missing prompt key or image, a chat template error)."""
BATCHES_DEAD = "batches_dead"
"""Training batches the learner dead-lettered."""
SAMPLES_DEAD = "samples_dead"
"""Samples in those batches."""
BATCH_GROUPS_DEAD = "batch_groups_dead"
"""Groups in those batches (dropped: never trained)."""
EVAL_DEAD = "eval_dead"
"""Evaluation prompts dead-lettered (closed rounds)."""
EVAL_MISSING = "eval_missing"
"""Evaluation prompts with no answer when their round timed out."""
DEAD_LETTERS = "dead_letters"
"""Dead letters seen, of every stream."""
REWARD_DEAD_LETTERED = "reward_dead_lettered"
"""Dead letters from the ``trajectories`` stream (the reward tier gave up on them)."""
DEAD_LETTERS_FORGED = "dead_letters_forged"
"""Dead letters about batches not signed with the run's weights key (not the learner's): refused, nothing done."""
COUNTERS = (
    GROUPS_DEAD,
    GROUPS_TIMED_OUT,
    GROUPS_FILTERED,
    SAMPLES_TOO_STALE,
    LATE_SAMPLES_DROPPED,
    PROMPTS_TOO_LARGE,
    PROMPTS_BAD,
    BATCHES_DEAD,
    SAMPLES_DEAD,
    BATCH_GROUPS_DEAD,
    EVAL_DEAD,
    EVAL_MISSING,
    DEAD_LETTERS,
    REWARD_DEAD_LETTERED,
    DEAD_LETTERS_FORGED,
)


@dataclass(frozen=True)
class RunState:
    """The bus and the run's names, with the reads every component needs; writes go through
    :meth:`tx` or a :class:`~streamrl.coordinator.scripts.FencedScript` (see the module docstring)."""

    bus: Bus
    names: StreamNames

    @property
    def redis(self) -> aioredis.Redis:
        return self.bus.redis

    def key(self, name: str) -> str:
        return self.names.state(name)

    def tx(self) -> Tx:
        """A transaction: atomic, fenced by the coordinator's lease, run once however often it is re-sent."""
        return self.bus.tx()

    async def get_raw(self, name: str) -> bytes | None:
        """A state key's value as stored (None: absent) - what a ``tx.require`` compares against."""
        value = await self.redis.get(self.key(name))
        return raw(value) if value is not None else None

    async def get_int(self, name: str) -> int:
        value = await self.redis.get(self.key(name))
        return int(value) if value is not None else 0

    async def counters(self) -> dict[str, int]:
        """Every counter of :data:`COUNTERS` (one round trip)."""
        values = await self.redis.mget([self.key(name) for name in COUNTERS])
        return {name: int(v) if v is not None else 0 for name, v in zip(COUNTERS, values, strict=True)}
