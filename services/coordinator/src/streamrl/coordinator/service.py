"""CoordinatorService: owns the run - prompts, policy version, staleness, batching, evaluation.

The pieces, one concept per module, wired here:

* ``groups.GroupBuffer``: training groups from issue to batch (complete, filter, fail, time out);
* ``issuing.PromptIssuer``: training prompts under admission control (``admission.py``);
* ``batches.BatchBuilder``: ready groups into training batches (``batching.py``), dead batches counted;
* ``evaluation.EvalRounds``: evaluation rounds, started atomically, always closed;
* ``followers.follow``: the tails of ``weights`` and ``dead``; ``dead_letters`` says what a letter lost;
* with lanes (``lanes.count = K > 1``, :mod:`streamrl.common.lanes`): this coordinator serves lane ``lane``
  (``ctx.names`` and ``ctx.bus`` are the lane's): the dataset positions ``i mod K == k``, lane batches of
  ``prompts_per_step / K`` groups, evaluation on lane 0 only (``CoordinatorConfig.for_lane``); its
  ``weights`` and ``dead`` are the lane's, which lane 0's ``joining.run_joiner`` fills from the home;
* ``progress.Progress`` and ``metrics.MetricsWriter``: what a user sees;
* the run pauses - no prompt and no replacement issued, ``paused`` with the cause on the progress line, one
  ERROR line - while every live reward worker is paused (its heartbeat says why: a scorer's token refused, its
  backend down; :mod:`streamrl.reward.pause`) or the error budget is spent (``error_budget.py``: too many of
  the groups settled lately failed); it resumes by itself (one INFO line) when they resume or the budget's
  window has passed;
* ``traces``: where each prompt group's trace starts and what its samples waited for (``ctx.tracing``);
  ``ctx.metrics`` exports the ``scored`` stream's lag and the staleness of each batch's samples.

Tasks of :meth:`CoordinatorService.run`:

* a consumer loop on ``scored``: stores each scored record in its group's (or evaluation
  round's) buffer, atomically with the ack, de-duplicated by trajectory id (an evaluation record's
  payload is deleted in that commit: it is never trained on; a record naming no payload key of this run
  for its trajectory is refused, dead-lettered);
* the ``weights`` tail: the learner's events raise the policy version (kept in Redis, never
  decreasing; an evaluation round due at a version is started before the version counts);
* the ``dead`` tail: a dead letter fails its group (replaced), counts against its evaluation round,
  counts a batch the learner gave up on as dropped, or sends again a batch it refused unconsumed;
* one tick that, every few ms: times out overdue groups, completes groups, builds batches, issues
  prompts, closes evaluation rounds, publishes progress, and ends the run after ``total_steps``
  once no evaluation round is open.

All run state lives in Redis (``state.py``), so a restarted coordinator continues.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from streamrl.common.aio import cancel_and_wait, wait_set
from streamrl.common.bus import Output
from streamrl.common.consumer import ConsumerLoop
from streamrl.common.errors import PoisonMessageError
from streamrl.common.health import live_heartbeats_async
from streamrl.common.lanes import home_run_id
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import DeadLetter, ScoredRecord, TrajectoryRecord, WeightsPublished
from streamrl.common.redact import redact
from streamrl.common.weights.auth import KEY_ENV, weights_key
from streamrl.coordinator import state as st
from streamrl.coordinator.batch_metrics import batch_stats
from streamrl.coordinator.batches import BatchBuilder, Built
from streamrl.coordinator.config import CoordinatorConfig
from streamrl.coordinator.dead_letters import (
    ForgedLetter,
    LostBatch,
    LostEvalPrompt,
    LostGroup,
    RefusedBatch,
    what_was_lost,
)
from streamrl.coordinator.error_budget import ErrorBudget
from streamrl.coordinator.evaluation import EvalRounds, round_buffer_id, round_of_buffer
from streamrl.coordinator.followers import follow
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.issuing import PromptIssuer
from streamrl.coordinator.joining import run_joiner
from streamrl.coordinator.metrics import MetricsWriter, plot, wandb_run
from streamrl.coordinator.mirror import Mirrored
from streamrl.coordinator.progress import REASON_CHARS, Progress, counter_metrics
from streamrl.coordinator.prompts import PromptSource
from streamrl.coordinator.scripts import FencedScript
from streamrl.coordinator.state import RunState
from streamrl.coordinator.traces import note_arrival

logger = logging.getLogger(__name__)
COUNT_LETTER_LUA = """
local function id(s) local ms, seq = string.match(s, '^(%d+)-(%d+)$'); return tonumber(ms), tonumber(seq) end
local last = redis.call('GET', KEYS[1])
if last then
  local lm, ls = id(last); local m, q = id(ARGV[1])
  if m < lm or (m == lm and q <= ls) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1]); redis.call('INCR', KEYS[2])
if ARGV[2] == '1' then redis.call('INCR', KEYS[3]) end
if ARGV[3] == '1' then redis.call('INCR', KEYS[4]) end
return 1
"""
"""Count a dead letter once, by its entry id (ids only grow). KEYS: dead_counted, dead_letters,
reward_dead_lettered, dead_letters_forged; ARGV: entry id, 1 when it came from the ``trajectories`` stream, 1 when
it is forged."""
TICK_S = 0.05
"""Longest pause between two ticks; stored trajectories and new versions wake the tick at once."""
WAKE_BATCH_S = 0.002
"""After a wake-up, wait this long so one tick handles a whole burst of stored trajectories."""
FULL_CHECK_S = 1.0
"""Every so often a tick checks timeouts and every evaluation round, not only touched ones."""
SWEEP_S = 30.0
"""How often a tick looks at every in-flight group for completeness (the first tick always does: after a restart
nothing is "touched" yet). In between only touched groups are looked at: a group completes only by a sample this
process stored and saw committed, so the sweep is a safety net - at 2,000 GPUs' worth of in-flight groups a
sweep every second cost more than the rest of the tick together."""


def buffer_id(traj: TrajectoryRecord) -> str:
    """The buffer a scored trajectory is stored in: its group's, or its evaluation round's."""
    return round_buffer_id(int(traj.metadata.get("eval_version", 0))) if traj.is_eval else traj.group_id


class CoordinatorService:
    """See the module docstring."""

    def __init__(self, config: CoordinatorConfig, ctx: ServiceContext) -> None:
        config = config.for_lane()
        self.cfg = config
        self.ctx = ctx
        self.names = ctx.names
        self.state = RunState(ctx.bus, ctx.names)
        self.metrics = MetricsWriter(
            config.run_dir,
            wandb=wandb_run(
                config.wandb_project,
                config.wandb_run_name or config.run_id,
                redact(config.model_dump(mode="json")),
            ),
        )
        self.progress = Progress(self.state)
        self.groups = GroupBuffer(self.state, group_size=config.group_size, dynamic_filtering=config.dynamic_filtering)
        self.issuer = PromptIssuer(config, self.state, self.groups, PromptSource(config.dataset), tracing=ctx.tracing)
        self.batches = BatchBuilder(
            self.state,
            self.groups,
            prompts_per_step=config.prompts_per_step,
            max_staleness=config.max_staleness,
            drop_stale=config.staleness_policy == "drop",
            tracing=ctx.tracing,
            tx_samples=config.batch_tx_samples,
            wait_s=config.batch_wait_s,
            manifest_part_bytes=config.manifest_part_kib * 1024,
        )
        self.evals = (
            EvalRounds(config, self.state, PromptSource(config.eval.dataset), self.metrics)
            if config.eval.dataset
            else None
        )
        self.version = 0
        self.wake = asyncio.Event()
        """Set when a scored trajectory is stored, a version is published or a group fails: the tick runs at once."""
        self.touched: set[str] = set()
        self.changed = True
        """Something besides a stored sample happened since the last batching and admission (see the tick)."""
        """Buffers (groups, evaluation rounds) that received a trajectory since the last tick looked."""
        self.full_check_at = 0.0
        self.sweep_at = 0.0
        self.next_plot_at = 0.0
        self.last_batch_time = time.monotonic()
        self.weights_key = weights_key()
        if self.weights_key is None:
            logger.warning(
                "weights events and dead letters about batches are not authenticated (%s is not set): any writer "
                "to the weights or dead stream can move the policy version or have untrained batches deleted",
                KEY_ENV,
            )
        self.budget = ErrorBudget(config.max_dead_fraction, config.dead_window_s, config.prompts_per_step)
        self.budget_cause = ""
        self.reward_cause = ""
        """Why every live reward worker is paused (their heartbeats, read every FULL_CHECK_S); empty if one is not."""
        self.paused = ""
        """Why no prompt is issued now (the run is paused); empty while it runs."""
        self.paused_since = 0.0
        self._count_letter = FencedScript(ctx.bus, COUNT_LETTER_LUA, "service.COUNT_LETTER_LUA")
        self.mirrored = Mirrored([-1] * config.lanes.count) if config.lanes.enabled and config.lane == 0 else None
        """With lanes, lane 0's: the version each lane has. The run ends once every lane has the last one (a lane
        whose Redis was down gets it when it is back), never leaving a lane's coordinator waiting for it."""

    # -- entry ------------------------------------------------------------------------------
    async def run(self) -> None:
        self.version = await self.state.get_int(st.POLICY_VERSION)
        await self.groups.version_published(self.version, time.time())
        await self.groups.adopt_untracked(self.version, time.time())
        logger.info(
            "coordinator: %d prompts, group size %d, %d groups/step, max staleness %d, resuming at version %d",
            len(self.issuer.source),
            self.cfg.group_size,
            self.cfg.prompts_per_step,
            self.cfg.max_staleness,
            self.version,
        )
        scored_loop: ConsumerLoop[ScoredRecord] = ConsumerLoop(
            self.ctx.bus,
            self.names,
            stream=self.names.scored,
            group="coordinator",
            consumer="coordinator",
            handler=self.handle_scored,
            message_type=ScoredRecord,
            config=self.cfg.consumer,
            on_committed=self._on_scored_committed,
        )
        self.ctx.loops.append(scored_loop)
        if self.cfg.redis.url is not None:  # always under service_main; tests may hand the service a bus
            self.ctx.metrics.watch_streams(self.cfg.redis.url, {"scored": self.names.scored})
        self.ctx.mark_running()
        self.ctx.policy_version = self.version
        done = asyncio.Event()
        stop_all = asyncio.Event()
        key = self.weights_key
        tasks = {
            asyncio.create_task(scored_loop.run(stop_all)): "scored consumer",
            asyncio.create_task(
                follow(self.state, self.names.weights, st.WEIGHTS_CURSOR, self.on_weights, stop_all, weights_key=key)
            ): "weights tail",
            asyncio.create_task(
                follow(self.state, self.names.dead, st.DEAD_CURSOR, self.on_dead, stop_all, weights_key=key)
            ): "dead-letter tail",
            asyncio.create_task(self._tick_forever(done, stop_all)): "tick",
        }
        if self.mirrored is not None:  # lane 0's coordinator joins the lanes' batches
            tasks[asyncio.create_task(run_joiner(self.cfg, self.ctx, stop_all, self.mirrored))] = "joiner"
        # A component that ends early (a bug raising in it) stops the run loudly instead of leaving
        # the others waiting for it forever.
        ends = [asyncio.create_task(self.ctx.stop.wait()), asyncio.create_task(done.wait())]
        await asyncio.wait([*ends, *tasks], return_when=asyncio.FIRST_COMPLETED)
        await cancel_and_wait(ends)
        stop_all.set()
        finished, hung = await asyncio.wait(tasks, timeout=self.cfg.consumer.shutdown_grace_s + 5.0)
        for task in hung:
            logger.error("coordinator %s did not stop within the grace period; cancelling it", tasks[task])
        await cancel_and_wait(hung)
        await asyncio.to_thread(self.metrics.close)  # (wandb.finish uploads)
        await asyncio.to_thread(plot, self.cfg.run_dir)
        for task in finished:
            if not task.cancelled() and task.exception() is not None:
                logger.error("coordinator %s failed", tasks[task], exc_info=task.exception())
                raise task.exception()  # type: ignore[misc]
        if not done.is_set() and not self.ctx.stop.is_set():
            raise RuntimeError(f"coordinator {', '.join(tasks[t] for t in finished)} ended before the run did")

    # -- handlers ---------------------------------------------------------------------------
    async def handle_scored(self, msg: ScoredRecord) -> list[Output]:
        traj = msg.trajectory
        if not traj.payload_key.startswith(self.names.payload(traj.id, "")):
            raise PoisonMessageError(
                f"scored record of {traj.id} names payload {traj.payload_key!r}, not a payload key of this run "
                f"for it ({self.names.payload(traj.id, '')}...)"
            )
        note_arrival(msg, time.time())
        stored = Output(key=self.names.group_buffer(buffer_id(traj)), field=traj.id, message=msg)
        if traj.is_eval:  # scored and reported, never trained: its payload goes now (or lives the retention)
            keep_ms = int(self.ctx.bus.payload_retention_s * 1000)
            drop = Output(key=traj.payload_key, op="expire", ttl_ms=keep_ms) if keep_ms > 0 else None
            return [stored, drop or Output(key=traj.payload_key, op="delete")]
        return [stored]

    async def _on_scored_committed(self, entry_id: str, msg: ScoredRecord) -> None:
        self.touched.add(buffer_id(msg.trajectory))
        self.wake.set()

    async def on_weights(self, entry_id: str, msg: Any) -> None:
        if not isinstance(msg, WeightsPublished):
            return
        self.changed = True
        self.wake.set()
        if msg.version > self.version:
            # the version's evaluation round is registered before the version counts: otherwise a
            # tick in between could find the run complete with no round pending, and end it
            if self.evals is not None:
                await self.evals.maybe_start(msg.version)
            await self.groups.version_published(msg.version, time.time())  # before timeouts see it
            self.version = msg.version
            await self.state.tx().set(self.state.key(st.POLICY_VERSION), self.version).execute()
            self.ctx.policy_version = self.version
        if msg.metrics:
            self.metrics.write(msg.version, dict(msg.metrics))
            self.progress.update({"loss": round(msg.metrics.get("learner/loss/policy", float("nan")), 4)})
        await self._maybe_plot()

    async def on_dead(self, entry_id: str, msg: Any) -> None:
        if not isinstance(msg, DeadLetter):
            return
        stream = msg.stream.rsplit(":", 1)[-1]
        run_id = home_run_id(self.names.run_id)
        lost = what_was_lost(msg, batches_stream=self.names.batches, key=self.weights_key, run_id=run_id)
        forged = isinstance(lost, ForgedLetter)
        reason = lost.reason if isinstance(lost, ForgedLetter) else msg.error
        k = self.state.key
        keys = [k(st.DEAD_COUNTED), k(st.DEAD_LETTERS), k(st.REWARD_DEAD_LETTERED), k(st.DEAD_LETTERS_FORGED)]
        if await self._count_letter(keys, [entry_id, int(msg.stream == self.names.trajectories), int(forged)]):
            logger.error("%s %s: %s", "forged dead letter" if forged else "dead letter from", stream, reason)
        self.progress.update({"dead_reason": reason[:REASON_CHARS]})
        await self._publish_progress(refresh=True)  # before any replacement goes out
        if isinstance(lost, LostGroup | LostEvalPrompt):  # the dead record's payload: no buffer names it
            payloads = [p for p in lost.payloads if p.startswith(self.names.payload_prefix)]
            if payloads:
                await self.ctx.bus.redis.unlink(*payloads)
        if isinstance(lost, LostGroup):
            if await self.groups.fail(lost.group_id, st.GROUPS_DEAD):
                self.budget.record(time.monotonic(), failed=1)
                logger.warning(
                    "group %s failed (dead-lettered member): a replacement prompt will be issued", lost.group_id
                )
        elif isinstance(lost, LostEvalPrompt):
            if self.evals is not None:
                await self.evals.record_dead(lost.version, lost.prompt_id)
        elif isinstance(lost, LostBatch):
            await self.batches.record_dead(lost.batch_id, lost.num_samples, lost.num_groups, msg.error, lost.buffers)
        elif isinstance(lost, RefusedBatch):
            limit = self.cfg.consumer.max_deliveries - 1
            if not await self.batches.resend(lost.batch_id, lost.payload, limit=limit, reason=msg.error):
                await self.batches.record_dead(
                    lost.batch_id,
                    lost.num_samples,
                    lost.num_groups,
                    f"refused {limit + 1} times, last: {msg.error}",
                    lost.buffers,
                )
        counters = await self._publish_progress(refresh=True)
        self.metrics.write(
            self.version,
            {
                "coordinator/dead_reason": reason[:500],
                "coordinator/dead_stream": stream,
                **counter_metrics(counters),
            },
        )
        self.changed = True
        self.wake.set()

    # -- the tick ---------------------------------------------------------------------------
    async def _tick_forever(self, done: asyncio.Event, stop: asyncio.Event) -> None:
        if self.evals is not None:
            await self.evals.maybe_start(self.version)
        while not stop.is_set():
            # Usually only the buffers that received trajectories are looked at; every FULL_CHECK_S timeouts
            # and every evaluation round are, and every SWEEP_S every in-flight group.
            now = time.monotonic()
            full = now >= self.full_check_at
            sweep = now >= self.sweep_at
            if full:
                self.full_check_at = now + FULL_CHECK_S
                timed_out = await self.groups.time_out(
                    version=self.version, now=time.time(), timeout_s=self.cfg.group_timeout_s
                )
                self.budget.record(now, failed=len(timed_out))
                await self._read_reward_pause()
            if sweep:
                self.sweep_at = now + SWEEP_S
            touched, self.touched = self.touched, set()
            rounds = {v for v in map(round_of_buffer, touched) if v is not None}
            groups = {b for b in touched if round_of_buffer(b) is None}
            checked = await self.groups.complete(None if sweep else groups)
            self.budget.record(now, completed=checked.left)
            await self.groups.drop_late(groups if sweep else checked.gone)
            # batching and admission read state that only a group leaving the in-flight set, a new version, a
            # dead letter or a batch built changes: a tick that saw none of these (a sample stored in a group not
            # complete yet, the usual case) skips their reads
            if full or checked.left or self.changed:
                self.changed = False
                for built in await self.batches.build(self.version):
                    self.changed = True  # the next batch may be buildable too, and admission moved
                    await self._record_batch(built)
                if not await self._paused(now):
                    await self.issuer.issue(self.version)
            evals_done = await self._finish_eval_rounds(look=full or bool(rounds))
            if self.evals is not None and rounds:
                await self.evals.drop_late(rounds)
            # the run ends on a fresh look at the rounds, never on the count remembered from an
            # earlier look (a round may have been started since)
            if (
                evals_done
                and self.version >= self.cfg.total_steps
                and (self.mirrored is None or self.mirrored.everywhere() >= self.cfg.total_steps)
                and await self._finish_eval_rounds(look=True)
            ):
                await self._publish_progress(refresh=True)
                done.set()
                return
            await self._publish_progress(refresh=full)
            if await wait_set(self.wake, TICK_S):
                await asyncio.sleep(WAKE_BATCH_S)  # let the rest of a burst of commits land first
            self.wake.clear()

    async def _read_reward_pause(self) -> None:
        beats = await live_heartbeats_async(self.ctx.bus.redis, self.names, "reward")
        paused = [b for b in beats if b.status == "paused"]
        whole = bool(paused) and len(paused) == len(beats)
        self.reward_cause = (
            f"reward paused ({len(paused)} of {len(beats)} workers): {paused[0].reason}" if whole else ""
        )

    async def _paused(self, now: float) -> bool:
        """Whether issuing is paused: every live reward worker is paused, or the error budget is spent; a change
        is said once (ERROR when it pauses, INFO when it resumes) and shown on the progress line."""
        tripped = self.budget.check(now)
        if tripped:
            self.budget_cause = f"{tripped}; last dead letter: {self.progress.fields.get('dead_reason', '-')}"
        causes = [c for c in (self.budget_cause if self.budget.paused(now) else "", self.reward_cause) if c]
        cause = "; ".join(causes)
        if cause == self.paused:
            return bool(cause)
        if cause:
            logger.error("run PAUSED, no prompt issued until this clears: %s", cause)
            self.progress.update({"paused": cause[: 2 * REASON_CHARS]})
            if not self.paused:
                self.paused_since = now
        else:
            logger.info("run resumed: issuing prompts again after %.0f s paused", now - self.paused_since)
            self.progress.clear("paused")
        self.paused = cause
        await self._publish_progress(refresh=False)
        return bool(cause)

    async def _finish_eval_rounds(self, look: bool) -> bool:
        """Close the evaluation rounds that can close; True when none is open."""
        if self.evals is None:
            return True
        closed = await self.evals.finish(look=look, timeout_s=self.cfg.group_timeout_s)
        if self.evals.last_acc is not None and self.progress.fields.get("eval_acc") != round(self.evals.last_acc, 3):
            self.progress.update({"eval_acc": round(self.evals.last_acc, 3)})
            await self._maybe_plot()
        return closed

    async def _record_batch(self, built: Built) -> None:
        batch = built.batch
        now = time.monotonic()
        stats = batch_stats(
            batch, elapsed_s=now - self.last_batch_time, num_too_stale=built.num_too_stale, waited_s=built.waited_s
        )
        self.last_batch_time = now
        self.ctx.metrics.observe_staleness(batch.staleness)
        self.ctx.metrics.count_samples("batched", len(batch.samples))
        counters = await self.progress.refresh_counters()
        self.metrics.write(batch.index, {**stats, **counter_metrics(counters)})
        self.progress.update(
            {
                "step": batch.index + 1,
                "reward": round(stats["rollout/reward_mean"], 3),
                "acc": round(stats["rollout/acc"], 3),
                "staleness": round(stats["coordinator/staleness_mean"], 2),
                "queue_s": round(stats["rollout/queue_s_mean"], 2),
                "tok/s": round(stats["rollout/tokens_per_s"], 1),
            }
        )
        logger.info("batch %d: %s", batch.index, " ".join(f"{k}={v:.3g}" for k, v in stats.items()))

    async def _publish_progress(self, refresh: bool) -> dict[str, int]:
        counters = await self.progress.refresh_counters() if refresh else {}
        await self.progress.publish(self.version)
        return counters

    async def _maybe_plot(self) -> None:
        if time.monotonic() >= self.next_plot_at:
            self.next_plot_at = time.monotonic() + self.cfg.plot_every_s
            await asyncio.to_thread(plot, self.cfg.run_dir)
