"""The coordinator's run state: every key it keeps under ``streamrl:{run}:state:``, named in one place.

All progress of a run lives in Redis, none in the process, so a coordinator killed at any point and
restarted continues where it stopped. The names below are the stored layout; a coordinator reads the
state an older one wrote (keys it adds are created as it goes, see ``GroupBuffer.adopt_untracked``).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from streamrl.common.bus import Bus
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
COUNTERS = (
    GROUPS_DEAD, GROUPS_TIMED_OUT, GROUPS_FILTERED, SAMPLES_TOO_STALE, LATE_SAMPLES_DROPPED, PROMPTS_TOO_LARGE,
    PROMPTS_BAD, BATCHES_DEAD, SAMPLES_DEAD, BATCH_GROUPS_DEAD, EVAL_DEAD, EVAL_MISSING, DEAD_LETTERS,
    REWARD_DEAD_LETTERED,
)  # fmt: skip


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
        raw = await self.redis.get(self.key(name))
        return bytes(raw) if raw is not None else None

    async def get_int(self, name: str) -> int:
        raw = await self.redis.get(self.key(name))
        return int(raw) if raw is not None else 0

    async def counters(self) -> dict[str, int]:
        """Every counter of :data:`COUNTERS` (one round trip)."""
        values = await self.redis.mget([self.key(name) for name in COUNTERS])
        return {name: int(v) if v is not None else 0 for name, v in zip(COUNTERS, values, strict=True)}
