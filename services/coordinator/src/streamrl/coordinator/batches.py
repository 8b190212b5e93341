"""The batch builder: ready groups become training batches on the ``batches`` stream, and batches
the learner gave up on are accounted for.

Which groups go into batch ``k`` is the pure rule of ``batching.py``. Here it meets Redis: groups over
the staleness bound are dropped (their replacements owed the version batch ``k`` needs), and batch
``k`` (id ``batch-{k}``, from its index) is published in the same transaction that removes its groups
from ``ready`` and sets ``batch_index`` to ``k + 1`` - on the precondition that ``batch_index`` is
still ``k`` (compare-and-set). A re-send of that transaction after a lost reply runs it once
(:mod:`streamrl.common.tx`), and a builder whose view is out of date (a restarted or deposed
coordinator, which the lease fence stops anyway) finds the index taken, writes nothing and reads the
state again: the ``batches`` stream never holds an index twice nor skips one.

A batch the learner cannot train (it failed ``max_deliveries`` times, or came from the future) reaches
the ``dead`` stream as a DeadLetter holding the TrainingBatch. The learner still publishes a version
for it (version = batches consumed), so admission goes on; here it is counted once per batch id
(``batches_dead``, ``samples_dead``) with one error line - its groups are not in flight any more and
are never failed or replaced.

Each batch is the root of a trace of its own (``coordinator.batch``, its traceparent the batch's), and
the traced samples' waits in their group and for the batch are recorded as it is built (``traces.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from streamrl.common.codec import encode
from streamrl.common.messages import TrainingBatch
from streamrl.common.trace_schema import BATCH, BATCH_ID, NUM_SAMPLES, POLICY_VERSION, STEP_INDEX
from streamrl.common.tracing import NULL_TRACING, Attributes, Tracing
from streamrl.common.tx import PreconditionFailed, Tx
from streamrl.coordinator import state as st
from streamrl.coordinator.admission import staleness
from streamrl.coordinator.batching import ReadyGroup, select_groups
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.scripts import FencedScript
from streamrl.coordinator.state import RunState
from streamrl.coordinator.traces import record_waits

logger = logging.getLogger(__name__)

DEAD_BATCH_LUA = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('INCR', KEYS[2]); redis.call('INCRBY', KEYS[3], ARGV[2])
return 1
"""
"""Count a dead-lettered batch once. KEYS: dead_batch_ids, batches_dead, samples_dead; ARGV: id, samples."""


@dataclass(frozen=True)
class Built:
    """A batch published, with the samples dropped as too stale while it was built."""

    batch: TrainingBatch
    num_too_stale: int


class BatchBuilder:
    """Builds every batch the ready groups allow (see the module docstring)."""

    def __init__(
        self, state: RunState, groups: GroupBuffer, *, prompts_per_step: int, max_staleness: int,
        drop_stale: bool, tracing: Tracing = NULL_TRACING,
    ) -> None:  # fmt: skip
        self.state = state
        self.groups = groups
        self.per_step = prompts_per_step
        self.max_staleness = max_staleness
        self.drop_stale = drop_stale
        self.tracing = tracing
        self._dead_batch = FencedScript(state.bus, DEAD_BATCH_LUA)
        self.too_stale_since_batch = 0
        """Samples dropped as too stale since the last batch was built (reported with the next one)."""

    async def build(self, version: int) -> list[Built]:
        """Publish every batch that can be built now; ``version`` = the policy version now."""
        redis = self.state.redis
        built: list[Built] = []
        while await redis.llen(self.state.key(st.READY)) >= self.per_step:
            stored_index = await self.state.get_raw(st.BATCH_INDEX)
            index = int(stored_index) if stored_index is not None else 0
            ready_ids = await self.groups.ready()
            members = await self.groups.samples(ready_ids)
            ready = [ReadyGroup(g, min(s.trajectory.policy_version_start for s in members[g])) for g in ready_ids]
            pick = select_groups(ready, index=index, max_staleness=self.max_staleness, per_step=self.per_step,
                                 drop_stale=self.drop_stale)  # fmt: skip
            if pick.too_stale:
                num = sum(len(members[g.group_id]) for g in pick.too_stale)
                tx = self.state.tx().require(self.state.key(st.BATCH_INDEX), equals=stored_index)
                self.groups.queue_drop_ready(
                    tx, [g.group_id for g in pick.too_stale], max(index - self.max_staleness, 0)
                )
                tx.incrby(self.state.key(st.SAMPLES_TOO_STALE), num)
                if not await self._execute(tx, index):
                    continue
                self.too_stale_since_batch += num
                logger.warning("dropped %d groups (%d samples) over max_staleness=%d for batch %d",
                               len(pick.too_stale), num, self.max_staleness, index)  # fmt: skip
            if not pick.chosen:
                break
            samples = [s for g in pick.chosen for s in members[g.group_id]]
            batch_id = f"batch-{index}"
            attributes: Attributes = {BATCH_ID: batch_id, STEP_INDEX: index, POLICY_VERSION: version,
                                      NUM_SAMPLES: len(samples)}  # fmt: skip
            span = self.tracing.span(BATCH, attributes=attributes)
            created = time.time()
            record_waits(self.tracing, samples, batch_id=batch_id, built_at=created)
            batch = TrainingBatch(
                id=batch_id, index=index, samples=samples, policy_version=version,
                staleness=[staleness(index, s.trajectory.policy_version_start) for s in samples],
                created_at=created, traceparent=span.traceparent,
            )  # fmt: skip
            tx = self.state.tx().require(self.state.key(st.BATCH_INDEX), equals=stored_index)
            # not bus.encode: a batch is many trajectories, each already checked against the size limit
            tx.xadd_raw(self.state.names.batches, encode(batch))
            self.groups.queue_batched(tx, [g.group_id for g in pick.chosen])
            tx.set(self.state.key(st.BATCH_INDEX), index + 1)
            published = await self._execute(tx, index)
            span.end()
            if not published:
                continue
            built.append(Built(batch, self.too_stale_since_batch))
            self.too_stale_since_batch = 0
        return built

    async def _execute(self, tx: Tx, index: int) -> bool:
        """Run a transaction conditioned on ``batch_index`` still being ``index``; False when it was not
        (another builder moved it: nothing was written, the caller reads the state again)."""
        try:
            await tx.execute()
        except PreconditionFailed as e:
            logger.warning("batch %d: the run state moved under this coordinator (%s); reading it again", index, e)
            return False
        return True

    async def record_dead(self, batch_id: str, num_samples: int, reason: str) -> bool:
        """Count a batch the learner dead-lettered (once per id); False when it was counted before."""
        k = self.state.key
        fresh = bool(await self._dead_batch([k(st.DEAD_BATCH_IDS), k(st.BATCHES_DEAD), k(st.SAMPLES_DEAD)],
                                            [batch_id, num_samples]))  # fmt: skip
        if fresh:
            logger.error("%s (%d samples) was dead-lettered by the learner and will not be trained: %s",
                         batch_id, num_samples, reason)  # fmt: skip
        return fresh
