"""Prompt issuing: training prompts go out as admission control allows, each tagged with the policy
version it must be generated at.

How many and at which version is the pure rule of ``admission.py``; replacements for lost groups take
the versions they are owed first. Each prompt is XADDed in the same transaction that records its group
in flight (with that version and the issue time) and moves the dataset cursor from ``c`` to ``c + n``,
on the precondition that the cursor is still ``c`` (compare-and-set); the group id comes from the
dataset position (``p{position}``). With ``lanes.count = K > 1`` the coordinator of lane ``k`` issues only the
positions ``i mod K == k`` (its cursor counts its own prompts: position = cursor * K + k), so the K
coordinators' group ids never collide and a restarted one resumes its own shard. A restart never issues a prompt twice nor forgets one in flight, a re-send of
the transaction after a lost reply runs it once (:mod:`streamrl.common.tx`), and a coordinator whose
view is out of date writes nothing. No prompt goes out before a learner has published its
weights (``coordinator.wait_for_learner``): samples generated while it loads would only grow stale.
Each prompt starts its group's trace (``traces.py``): an issue span, ended once the prompt is out.

A dataset row that cannot become a prompt (``prompts.BadRowError``) or one over ``redis.max_message_mb``
is skipped: one line naming it, counted (``prompts_bad``, ``prompts_too_large``), and the cursor moves
past it. A whole dataset's worth of bad rows in a row stops the coordinator with that error instead of
skipping for ever. Rows are read (tokenized, their images loaded) in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from streamrl.common.errors import MessageTooLargeError
from streamrl.common.messages import PromptWorkItem, SamplingParams, Tensor
from streamrl.common.telemetry.trace_schema import GROUP_ID, ISSUE, POLICY_VERSION
from streamrl.common.telemetry.tracing import NULL_TRACING, Span, Tracing
from streamrl.common.tx import PreconditionFailed
from streamrl.coordinator import state as st
from streamrl.coordinator.admission import groups_admissible, new_group_versions, repaid
from streamrl.coordinator.config import CoordinatorConfig
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.prompts import BadRowError, Prompt, PromptSource
from streamrl.coordinator.state import RunState

logger = logging.getLogger(__name__)


def shard_position(cursor: int, lanes: int, lane: int) -> int:
    """The dataset position of the ``cursor``-th prompt of lane ``lane`` of ``lanes``: the positions
    ``i mod lanes == lane``, in order (every position when there are no lanes)."""
    return cursor * lanes + lane


class PromptIssuer:
    """Issues training prompts under admission control (see the module docstring)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        state: RunState,
        groups: GroupBuffer,
        source: PromptSource,
        tracing: Tracing = NULL_TRACING,
    ) -> None:
        self.cfg = config
        self.state = state
        self.bus = state.bus
        self.groups = groups
        self.source = source
        self.tracing = tracing
        s = config.sampling
        self.sampling = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_new_tokens=s.max_new_tokens,
            min_new_tokens=s.min_new_tokens,
            n=config.group_size,
            seed=s.seed,
        )
        self.learner_ready = False
        self.said_waiting = False
        self.bad_in_a_row = 0
        """Dataset rows skipped as bad since the last good one."""
        self.lanes = config.lanes.count
        self.lane = config.lane or 0

    async def _learner_is_ready(self, version: int) -> bool:
        """A learner has published weights (any version): it can train what the prompts produce."""
        if not self.learner_ready:
            self.learner_ready = (
                not self.cfg.wait_for_learner
                or version > 0
                or await self.state.redis.xlen(self.state.names.weights) > 0
            )
            if self.learner_ready:
                logger.info("a learner is ready: issuing prompts")
            elif not self.said_waiting:
                self.said_waiting = True
                logger.info(
                    "waiting for a learner to publish its weights before issuing prompts "
                    "(coordinator.wait_for_learner = false issues them at once)"
                )
        return self.learner_ready

    async def issue(self, version: int) -> int:
        """Issue every prompt admission allows at policy ``version``; returns how many were issued."""
        if not await self._learner_is_ready(version):
            return 0
        cfg = self.cfg
        in_flight = await self.groups.in_flight()
        accepted = await self.state.get_int(st.ACCEPTED)
        budget = groups_admissible(
            accepted=accepted,
            in_flight=in_flight,
            version=version,
            max_staleness=cfg.max_staleness,
            prompts_per_step=cfg.prompts_per_step,
            total_steps=cfg.total_steps,
            prefetch_steps=cfg.prefetch_steps,
        )
        if budget == 0:
            return 0
        owed = await self.groups.owed()
        versions = new_group_versions(
            budget,
            owed=owed,
            position=accepted + in_flight,
            version=version,
            max_staleness=cfg.max_staleness,
            prompts_per_step=cfg.prompts_per_step,
        )
        repay = repaid(budget, owed)
        stored_cursor = await self.state.get_raw(st.CURSOR)
        cursor = int(stored_cursor) if stored_cursor is not None else 0
        tx = self.state.tx().require(self.state.key(st.CURSOR), equals=stored_cursor)
        issued = too_large = bad = 0
        spans: list[Span] = []
        rows = await asyncio.to_thread(self._read, cursor, budget)  # tokenizing, reading images: off the loop
        for i, prompt in enumerate(rows):
            if isinstance(prompt, BadRowError):
                bad += 1
                self._note_bad(prompt)
                logger.error("skipping %s", prompt)
                continue
            self.bad_in_a_row = 0
            now = time.time()
            group, version = f"p{self.position(cursor + i)}", versions[issued]
            span = self.tracing.span(ISSUE, attributes={GROUP_ID: group, POLICY_VERSION: version}, start_s=now)
            item = PromptWorkItem(
                id=group,
                prompt_ids=Tensor.from_list(prompt.ids, "int32"),
                images=list(prompt.images),
                prompt_text=prompt.text,
                label=prompt.label,
                metadata=prompt.metadata,
                sampling=self.sampling,
                policy_version=version,
                issued_at=now,
                traceparent=span.traceparent,
            )
            try:
                payload = self.bus.encode(item, self.state.names.prompts)
            except MessageTooLargeError as e:
                too_large += 1
                logger.warning("skipping dataset prompt %d: %s", self.position(cursor + i) % len(self.source), e)
                span.fail(e)
                span.end()
                continue
            spans.append(span)
            tx.xadd_raw(self.state.names.prompts, payload)
            self.groups.queue_issue(tx, item.id, item.policy_version, now)
            issued += 1
        self.groups.queue_repay(tx, repay[:issued])
        tx.set(self.state.key(st.CURSOR), cursor + budget)
        tx.incrby(self.state.key(st.PROMPTS_TOO_LARGE), too_large)
        tx.incrby(self.state.key(st.PROMPTS_BAD), bad)
        try:
            await tx.execute()
        except PreconditionFailed as e:
            logger.warning("the dataset cursor moved under this coordinator (%s): nothing issued, reading it again", e)
            issued = 0
        for span in spans:
            span.end()
        return issued

    def position(self, cursor: int) -> int:
        """The dataset position of this coordinator's ``cursor``-th prompt: its lane's shard (:func:`shard_position`)."""
        return shard_position(cursor, self.lanes, self.lane)

    def _read(self, cursor: int, count: int) -> list[Prompt | BadRowError]:
        """The dataset's prompts ``cursor .. cursor + count - 1``, or the error of each bad row."""
        out: list[Prompt | BadRowError] = []
        for i in range(count):
            try:
                out.append(self.source.get(self.position(cursor + i)))
            except BadRowError as e:
                out.append(e)
        return out

    def _note_bad(self, error: BadRowError) -> None:
        """Count a bad row; a dataset's worth of them in a row is a dataset that cannot feed the run."""
        self.bad_in_a_row += 1
        if self.bad_in_a_row >= len(self.source):
            raise BadRowError(f"{len(self.source)} dataset rows in a row were bad, the last: {error}")
