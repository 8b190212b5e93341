"""LearnerService: training batches in, new weights out.

* A consumer loop on ``batches`` (one at a time, in order). For batch ``k`` at step ``k``: train one
  step, hand the new weights (version ``k + 1``) to the weight publisher ``learner.weights_transport``
  picks (:mod:`streamrl.torchkit.weights`: ZMQ server, CUDA IPC buffers or broadcast group), and publish
  WeightsPublished (its transport tag and fields, version, checksum, step metrics).
* With ``learner.lora.sync = "adapter"`` a version is the LoRA adapter alone (``payload = "lora"``,
  :mod:`~streamrl.learner.rl.adapter`), served the same way.
* A batch arrives as a BatchManifest (or, still accepted, a whole TrainingBatch): once its order is
  checked (a copy of a batch already consumed is recognised by its ids, before anything is read), the
  learner reads its samples' payloads (``batched:{batch}:{trajectory id}``, each the Trajectory the rollout
  worker stored once) that the manifest names, in replies of at most ``redis.max_command_mb``, and
  assembles each ScoredTrajectory from the manifest's scored record and its payload
  (:mod:`streamrl.common.batch_payloads`; a split manifest's parts first). The reads overlap the previous
  step: while batch ``k`` trains, :class:`~streamrl.learner.rl.prefetch.Prefetcher` reads the entry after
  ``k``'s when it is the manifest of batch ``k + 1`` (at most one batch held), and the handler of that entry
  takes it after its order and duplicate checks instead of reading Redis. A payload missing skips the batch (dead letter, version published with unchanged weights): never
  trained short. The payloads are deleted with the acknowledgement of the batch (below), so a replay after
  a restart reads them again; with ``redis.payload_retention_s`` they are given that long to live instead.
  With lanes (``lanes.count > 1``) the batches are the joined ones of the home and each key is read and
  deleted on the Redis of its lane (:mod:`streamrl.learner.rl.lanes`): a lane's Redis down is waited out
  however long it lasts, never a reason to skip a batch or to exit.
* Batches are acknowledged only once a checkpoint covers them (every ``checkpoint_every`` steps; the
  checkpoint's files are on disk by then, :mod:`streamrl.learner.durable`). A killed learner restarts
  from its last checkpoint and replays, in order, exactly the batches it had not checkpointed (they
  are still pending for it). The acknowledged high-water mark is kept in Redis with the acks: a
  learner whose checkpoint is behind it (an older checkpoint restored, the newest deleted) refuses
  to start with one line naming both, since the batches in between are gone.
* Batches are trained strictly in index order, whatever reaches the learner (rules in
  :mod:`~streamrl.learner.rl.batch_order`): a copy of a batch already consumed at its index (a re-sent
  publication, a replay after a restart) is skipped quietly; another batch at a taken index is
  dead-lettered loudly naming both; a batch ahead of the next index is dead-lettered while an entry
  for a missing index is still to come, else the gap is confirmed and each missing index is recorded
  as lost (dead letter, version published with unchanged weights) before it trains. The learner never
  waits on an index no one will write.
* Every step is counted in Redis per batch *before* it runs and again when it returns, so the count
  survives restarts and a step that killed the process (OOM-kill, segfault, a follower rank dying)
  counts too (so does a failure on rank 0 alone in a group: it may be the symptom of another rank's
death). A step that fails before any backward pass (on every rank together: every rank of a
  group agrees on a step's outcome, :mod:`~streamrl.learner.rl.group`) is retried; one that fails
  after has left gradients or weights half-updated, and one that failed on one rank alone may have
  left the others in a collective: neither is retried in this process: the learner stops with the
  error (exit 1), the batch still pending, and a restart resumes from the last checkpoint. A batch
  whose failures and kills reached ``consumer.max_deliveries`` (or with no samples) is skipped:
  dead-lettered with its last error ("killed its consumer N times" for kills), and its version still
  published (the same weights), so versions keep counting batches and the coordinator's admission
  never waits for it.
* What follows a step - checkpoint, export, publishing its version - is finished on retry when it
  fails (the batch is not trained again); ``consumer.max_deliveries`` failures in a row stop the
  learner (exit 1: a restart resumes from the checkpoint).
* The last published event is kept in Redis (written atomically with it). A learner resumed from a
  checkpoint older than that version retrains the batches in between without republishing their
  versions, except the newest one: its weights died with the old learner if no worker had fetched
  them, so it is published again with the retrained weights (same version, another checksum;
  workers serving the lost weights reload) and the run goes on from there.
* At start the learner serves its current version (0, or the checkpoint's) so rollout workers know
  where to fetch weights; after the last step it exports the policy in Hugging Face format.
* Every Redis write of the learner is a fenced, idempotent transaction (``Bus.tx``) in
  :class:`~streamrl.learner.rl.ledger.LearnerLedger`. The write points: (1) ``claim`` / ``lose``: the
  fingerprint of what is consumed at an index (HSET); (2) ``start``: a step's attempt, before it runs
  (HINCRBY); (3) ``finish``: after it, with its error (HINCRBY, HSET); (4) ``publish``: a version - the
  WeightsPublished XADD, ``published`` and the publication mark, compare-and-set; (5)
  ``dead_letter_once``: a skipped or lost batch's dead letter (XADD, guarded by a marker key); (6)
  ``ack``: XACK of the entries a checkpoint covers with the ``acked`` mark, their failure keys and old
  fingerprints deleted. The consumer loop's own commits for the learner write nothing (``ack=False``,
  no outputs); its dead letters (a conflicting copy, an out-of-order batch) are written while the
  entry is pending, so once.
* A learner group (``learner.ranks`` > 1, or a ``torchrun`` launch) runs this service on rank 0
  only; what every rank must do together (a step, gathering the weights, a checkpoint, an export)
  goes through :class:`~streamrl.learner.rl.group.LearnerGroup`, whose other ranks follow rank 0.
* Traced (``traces.py``; rank 0 only): a step span per batch linked to its traced samples, a training
  span per traced sample with its staleness (learner version - behaviour version, the figures logged
  as ``learner/staleness_*``) and correction figures, a publish span per version; ``ctx.metrics``
  exports the staleness histogram, samples and tokens trained, weight-publish seconds per path and
  the ``batches`` stream's lag.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from streamrl.common.batch_payloads import MissingPayloadError, fetch_batch, load_manifest, owned_buffers
from streamrl.common.bus import Output
from streamrl.common.codec import encode
from streamrl.common.consumer import ConsumerLoop, current_entry
from streamrl.common.errors import PoisonMessageError, RetryableError
from streamrl.common.lanes import LaneClients
from streamrl.common.lease import LeaseLostError
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import BATCH_SKIPPED, BatchManifest, DeadLetter, TrainingBatch, WeightsPublished
from streamrl.common.telemetry.trace_schema import NUM_BYTES, POLICY_VERSION, STEP_INDEX, WEIGHTS_PATH, WEIGHTS_PUBLISH
from streamrl.common.telemetry.tracing import weights_traceparent
from streamrl.common.weights.auth import sign, weights_key
from streamrl.learner.rl.adapter import adapter_shape
from streamrl.learner.rl.batch_order import Batch, behind_verdict, fingerprint, gap_verdict
from streamrl.learner.rl.config import LearnerConfig
from streamrl.learner.rl.group import LearnerGroup
from streamrl.learner.rl.lanes import close_lanes, connect_lanes
from streamrl.learner.rl.ledger import LearnerLedger
from streamrl.learner.rl.prefetch import Prefetcher
from streamrl.learner.rl.traces import record_train_spans, start_step, step_figures, traced_rows
from streamrl.learner.rl.trainer import RLTrainer, StepFailedError
from streamrl.torchkit.weights.factory import make_publisher
from streamrl.torchkit.weights.protocol import WeightPublisher
from streamrl.torchkit.weights.tied import TIED_ALIASES

logger = logging.getLogger(__name__)


@dataclass
class _Consumed:
    """A batch counted as consumed (the step counter moved) whose checkpoint / export / publication is not done."""

    batch_id: str
    index: int
    metrics: dict[str, float]
    skipped: str = ""
    done: set[str] = field(default_factory=set)
    failures: int = 0


class LearnerService:
    """See the module docstring."""

    def __init__(self, config: LearnerConfig, ctx: ServiceContext, trainer: RLTrainer, group: LearnerGroup) -> None:
        self.cfg = config
        self.ctx = ctx
        self.trainer = trainer
        self.group = group
        self.ledger = LearnerLedger(ctx.bus, ctx.names)
        self.step = 0
        self.next_index = 0
        """Index of the next batch to train (batches below it are replays)."""
        self.checkpointed_step = 0
        self.checkpointed_index = 0
        self.acked_index = 0
        """Every batch index below it is acknowledged (kept in Redis with the acks)."""
        self.unacked: list[tuple[str, int, str, list[str]]] = []
        """(entry id, batch index, batch id, its manifest's sample hashes) of entries handled but not yet
        acknowledged."""
        self.lost: list[tuple[int, str]] = []
        """(index, batch id) of indices recorded as lost, whose keys go with the next ack that covers them."""
        self.weights_key = weights_key()
        """Signs every WeightsPublished (rollout workers with the key refuse events without it)."""
        lora = config.lora
        self.adapter = adapter_shape(trainer.policy.module) if lora is not None and lora.sync == "adapter" else None
        """The LoRA adapter's shape when versions carry the adapter alone (no tied head to add then)."""
        self.publisher: WeightPublisher = make_publisher(
            config.weights_transport,
            host=config.weights_host,
            port=config.weights_port,
            advertise_host=config.weights_advertise_host,
            store_port=config.weights_store_port,
            bucket_bytes=config.weights_bucket_mb * 2**20,
            broadcast_timeout_s=config.weights_broadcast_timeout_s,
            zmq_fallback=config.weights_zmq_fallback,
            tied_aliases={} if self.adapter is not None else TIED_ALIASES,
            ipc_buffer_sets=config.weights_ipc_buffer_sets,
            ipc_reader_wait_s=config.weights_ipc_reader_wait_s,
            delta_max_behind=config.weights_delta_max_behind,
        )
        self.loop: ConsumerLoop[Batch] | None = None
        self.fatal: RuntimeError | None = None
        """Set when a step failed half-way: the service stops and ``run`` raises it."""
        self.published = -1
        """The newest version this run's learner published (kept in Redis across restarts)."""
        self.mark: str | None = None
        """The publication mark in Redis as this learner last saw it (:meth:`LearnerLedger.publish`)."""
        self.life = secrets.token_hex(4)
        self.skipped: dict[str, str] = {}
        self.lanes = LaneClients(ctx.bus.redis, [])
        """Where a batch's parts and payloads are read and deleted: the home, and each lane's Redis when the run
        has lanes (connected in :meth:`run`)."""
        self.prefetcher = Prefetcher(ctx.bus.redis, ctx.names.batches, max_reply_bytes=ctx.bus.max_command_bytes)
        """Reads the next batch while one trains (rank 0's service alone reads Redis)."""
        self.loaded_buffers: dict[str, list[str]] = {}
        """Per split manifest read (by batch id), until its entry is committed: every key it names."""
        """Batch id -> reason, for skipped batches whose dead letter is written once they are committed."""
        self.num_skipped = 0
        self.consumed: _Consumed | None = None

    async def run(self) -> None:
        self.lanes = self.prefetcher.clients = await connect_lanes(
            self.ctx.bus.redis, self.cfg.run_id, self.cfg.lanes, self.cfg.redis
        )
        try:
            await self._run()
        finally:
            await close_lanes(self.lanes)

    async def _run(self) -> None:
        state = await asyncio.to_thread(self.group.resume)
        if state is not None:
            self.step = self.checkpointed_step = int(state["step"])
            self.next_index = self.checkpointed_index = int(state.get("next_index", self.step))
            logger.info("resumed from checkpoint at step %d", self.step)
        self.acked_index = await self.ledger.acked_index()
        if self.acked_index > self.next_index:
            logger.error(
                "the checkpoint at step %d (next batch index %d) is behind the batches already acknowledged (up to "
                "index %d), which are gone: restore the newest checkpoint of %s (or start a new run_id); not starting",
                self.step,
                self.next_index,
                self.acked_index - 1,
                Path(self.cfg.run_dir) / "checkpoints",
            )
            await asyncio.to_thread(self.group.stop)
            self._close()
            raise SystemExit(1)
        published = await self.ledger.published()
        self.published = published.version if published is not None else -1
        self.mark = await self.ledger.version_mark()
        if state is not None and self.step > self.published:
            # killed between the checkpoint and its version's commit: publish that step's event now,
            # naming its batch (the replayed entry is then skipped as trained) with the step's metrics
            logger.warning("version %d was checkpointed but not published before the restart: publishing it", self.step)
            if state.get("skipped"):
                self.skipped[state["batch_id"]] = state["skipped"]
            await self._publish(dict(state.get("metrics", {})), state.get("batch_id", ""))
        elif self.step >= self.published:
            await self._publish(metrics={})
        else:
            logger.warning(
                "resumed at step %d, but versions up to %d were published before the restart: batches %d..%d "
                "are trained again, and only the last version is published again",
                self.step,
                self.published,
                self.next_index,
                self.next_index + self.published - self.step - 1,
            )
        self.loop = ConsumerLoop(
            self.ctx.bus,
            self.ctx.names,
            stream=self.ctx.names.batches,
            group="learner",
            consumer="learner",
            handler=self.handle,
            message_type=(BatchManifest, TrainingBatch),
            config=self.cfg.consumer.model_copy(
                # failures are counted per batch in Redis by ``handle`` (which skips a batch at the limit)
                update={"max_in_flight": 1, "count": 1, "max_deliveries": 2**31 - 1}
            ),
            ack=False,
            on_committed=self._on_committed,
            max_message_bytes=None,  # a batch is many trajectories, each checked against the limit
            letter_key=self.weights_key,  # its letters about batches are believed only when signed
        )
        self.ctx.loops.append(self.loop)
        if self.cfg.redis.url is not None:  # always under service_main; tests may hand the service a bus
            self.ctx.metrics.watch_streams(self.cfg.redis.url, {"batches": self.ctx.names.batches})
        self.ctx.mark_running()
        try:
            await self.loop.run(self.ctx.stop, burst=self.ctx.burst)
        finally:
            self._close()
        if self.fatal is not None:
            raise self.fatal  # the other ranks, if any, die with this one
        await asyncio.to_thread(self.group.stop)  # not on an exception: the group then dies with this rank

    def _close(self) -> None:
        self.prefetcher.close()
        self.publisher.close()

    async def handle(self, entry: Batch) -> list[Output]:
        if not await self._in_order(entry):  # before any payload is read: a copy of a trained batch reads none
            return []
        if not (entry.num_samples if isinstance(entry, BatchManifest) else entry.samples):
            return await self._skip(entry, "it has no samples")
        attempts = await self.ledger.attempts(entry.id)
        if attempts.exhausted(self.cfg.consumer.max_deliveries):
            return await self._skip(entry, attempts.reason())
        if isinstance(entry, BatchManifest):
            budget = self.ctx.bus.max_command_bytes
            try:
                fetched = await self.prefetcher.take(current_entry(), entry)  # read while the last step trained
                if fetched is None:
                    whole = await load_manifest(self.lanes, entry, max_reply_bytes=budget)
                    fetched = whole, await fetch_batch(self.lanes, whole, max_reply_bytes=budget)
                whole, batch = fetched
                if whole.parts:  # what the ack deletes: the payloads its parts name too
                    self.loaded_buffers[entry.id] = whole.buffers
            except (MissingPayloadError, PoisonMessageError) as e:  # never trained short
                return await self._skip(entry, str(e))
        else:
            batch = entry
        backward_calls = self.trainer.policy.backward_calls
        traced = traced_rows(batch)
        span = start_step(self.ctx.tracing, batch, traced, version=self.step)
        await self.ledger.start(batch.id)  # before the step: a step that kills the process is counted too
        self.prefetcher.start(current_entry(), batch.index + 1)  # the next batch is read while this one trains
        started = time.time()
        try:
            metrics = await asyncio.to_thread(self.group.step, batch)
        except Exception as e:  # counted, then retried or fatal (re-raised either way)
            span.fail(e)
            span.end()
            await self._step_failed(batch, e, backward_calls)
            raise
        await self.ledger.finish(batch.id, None)
        ended = time.time()
        staleness = [self.step - s.trajectory.policy_version_start for s in batch.samples]
        metrics["learner/staleness_mean"] = sum(staleness) / len(staleness)
        metrics["learner/staleness_max"] = float(max(staleness))
        span.set_attributes(step_figures(metrics))
        record_train_spans(
            self.ctx.tracing,
            batch,
            traced,
            version=self.step,
            staleness=staleness,
            corrections=self.trainer.sample_corrections,
            start_s=started,
            end_s=ended,
        )
        span.end(ended)
        self.ctx.metrics.observe_staleness(staleness)
        self.ctx.metrics.count_samples("trained", len(batch.samples), int(metrics["learner/tokens"]))
        self._consume(batch, metrics)
        await self._finish()
        return []

    async def _in_order(self, batch: Batch) -> bool:
        """Whether ``batch`` is the one to train now (its index claimed); False: it was consumed before (a copy,
        or the batch whose checkpoint / export / publication is finished now). PoisonMessageError: refused."""
        if self.consumed is not None:  # what followed a consumed batch failed: finish it, never train it again
            again = self.consumed.batch_id == batch.id and self.consumed.index == batch.index
            logger.warning(
                "finishing what follows %s's step (%s)",
                self.consumed.batch_id,
                ", ".join(sorted(self.consumed.done)) + " done" if self.consumed.done else "nothing done",
            )
            await self._finish()
            if again:
                return False
        if batch.index < self.next_index:
            if (error := behind_verdict(batch, self.next_index, await self.ledger.record(batch.index))) is not None:
                logger.error("%s", error)
                raise PoisonMessageError(error)
            logger.info(
                "skipping %s: a copy of what was consumed at index %d (next index %d)",
                batch.id,
                batch.index,
                self.next_index,
            )
            return False
        if batch.index > self.next_index:
            await self._fill_gap(batch)
        record, mine = await self.ledger.record(batch.index), fingerprint(batch)
        if record is not None and record != mine:  # another batch was consumed at this index in an earlier life
            error = behind_verdict(batch, self.next_index, record)
            logger.error("%s", error)
            raise PoisonMessageError(error)
        if record is None:
            await self.ledger.claim(batch.index, mine)
        return True

    async def _step_failed(self, batch: TrainingBatch, e: Exception, backward_calls: int) -> None:
        """Count a failed step; return to let the consumer retry it, or stop the learner (raises CancelledError)."""
        agreed = isinstance(e, StepFailedError) or self.group.world == 1  # every rank stopped at the same point
        error = str(e) if isinstance(e, StepFailedError) else f"{type(e).__name__}: {e}"
        if agreed:
            await self.ledger.finish(batch.id, error)
        else:  # maybe the symptom of another rank's death (a closed connection): the step counts as a kill
            await self.ledger.note(batch.id, error)
        if agreed and self.trainer.policy.backward_calls == backward_calls:
            return  # nothing trained yet: the consumer retries it (skipped once at the limit)
        why = "after training part of the batch" if agreed else "on this rank alone (the others may be in a collective)"
        self.fatal = RuntimeError(
            f"{batch.id}: the step failed {why} ({error}); stopping: a restart resumes from the last checkpoint"
        )
        self.ctx.stop.set()
        raise asyncio.CancelledError(str(self.fatal)) from e  # leaves the batch pending, unretried

    async def _fill_gap(self, batch: Batch) -> None:
        """``batch`` is ahead of the next index: train first each missing index still in the stream (taken from
        it by entry id), refuse a batch from the future, and record every missing index no entry is left for as
        lost (dead letter, version published with unchanged weights)."""
        while True:
            still_to_come = await self.ledger.still_to_come(self.ctx.names.batches)
            gap = gap_verdict(batch, self.next_index, still_to_come, await self.ledger.coordinator_index())
            if gap.error is not None:
                logger.error("%s", gap.error)
                raise PoisonMessageError(gap.error)
            if gap.first is None:
                break
            index, entry_id = gap.first
            earlier = await self.ledger.entry(self.ctx.names.batches, entry_id)
            if earlier is None:  # acknowledged or trimmed since the look, or undecodable (dead-lettered on delivery)
                raise RetryableError(f"{batch.id} waits for batch index {index} (entry {entry_id})", defer_s=1.0)
            logger.warning(
                "%s is ahead of the learner, whose next batch is %d; batch index %d is still in the stream "
                "(entry %s: its delivery was lost or it was published again): training it first",
                batch.id,
                self.next_index,
                index,
                entry_id,
            )
            await self.handle(earlier)
            await self._on_committed(entry_id, earlier)
            if batch.index <= self.next_index:
                return
        missing = gap.lost
        logger.error(
            "batch indices %d..%d never reached the learner: %s came next and no entry for them is pending or left "
            "in the stream; recording them as lost (their versions are published with unchanged weights)",
            missing[0],
            missing[-1],
            batch.id,
        )
        for index in missing:
            lost = TrainingBatch(
                id=f"batch-{index}", index=index, samples=[], policy_version=batch.policy_version, staleness=[]
            )
            reason = (
                f"index {index} never reached the learner ({batch.id} came next; no entry for it was pending "
                "or left in the stream)"
            )
            await self.ledger.lose(index)
            self.lost.append((index, lost.id))
            await self._dead_letter(lost, "", reason)
            self.num_skipped += 1
            self._consume(lost, {"learner/batches_skipped": float(self.num_skipped)}, skipped=reason)
            await self._finish()

    async def _skip(self, batch: Batch, reason: str) -> list[Output]:
        """Consume ``batch`` without training it: its version is published with unchanged weights."""
        logger.error("skipping %s untrained (its samples are dropped): %s", batch.id, reason)
        traced = batch if isinstance(batch, TrainingBatch) else _header(batch)  # a manifest: no sample traces
        with start_step(self.ctx.tracing, traced, traced_rows(traced), version=self.step) as span:
            span.fail(f"{BATCH_SKIPPED}: {reason}")
        self.skipped[batch.id] = reason
        self.num_skipped += 1
        self._consume(batch, {"learner/batches_skipped": float(self.num_skipped)}, skipped=reason)
        await self._finish()
        return []

    def _consume(self, batch: Batch, metrics: dict[str, float], skipped: str = "") -> None:
        """Count ``batch`` as consumed: the step counter moves; :meth:`_finish` does what follows."""
        self.step += 1
        self.next_index = batch.index + 1
        self.consumed = _Consumed(batch.id, batch.index, metrics, skipped)

    async def _finish(self) -> None:
        """What follows the consumed batch's step, each part once: checkpoint / export when due, then publish
        its version (unless a version this high was published before a restart). A part that fails is done
        again at the next delivery of the batch (the consumer retries it), never the step."""
        c = self.consumed
        assert c is not None
        run_dir = Path(self.cfg.run_dir)
        parts = {
            "checkpoint": self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.total_steps,
            "export": bool(self.cfg.export_every and self.step % self.cfg.export_every == 0),
            "final export": self.step == self.cfg.total_steps,
            "publish": True,
        }
        part = ""
        try:
            for part in (p for p, due in parts.items() if due and p not in c.done):
                if part == "checkpoint":
                    await asyncio.to_thread(self._checkpoint, c.batch_id, c.metrics, c.skipped)
                elif part == "export":
                    await asyncio.to_thread(self.group.export, run_dir / "exports" / f"step-{self.step}")
                elif part == "final export":
                    export = Path(self.cfg.export_dir or run_dir / "final")
                    await asyncio.to_thread(self.group.export, export)
                    logger.info("exported the final policy to %s", export)
                else:
                    self._log_step(c.metrics)
                    await self._publish_step(c)
                c.done.add(part)
        except LeaseLostError:
            raise  # fenced off: the consumer loop stops this process
        except Exception as e:  # counted, then re-raised: the consumer retries the batch
            c.failures += 1
            logger.error(
                "%s: the %s after its step failed (%d times): %s: %s", c.batch_id, part, c.failures, type(e).__name__, e
            )
            if c.failures >= self.cfg.consumer.max_deliveries:
                self.fatal = RuntimeError(
                    f"{c.batch_id}: the {part} after its step failed {c.failures} times ({type(e).__name__}: {e}); "
                    "stopping: a restart resumes from the last checkpoint"
                )
                self.ctx.stop.set()
                raise asyncio.CancelledError(str(self.fatal)) from e
            raise
        self.consumed = None

    def _log_step(self, metrics: dict[str, float]) -> None:
        logger.info(
            "step %d: %s",
            self.step,
            " ".join(f"{k.removeprefix('learner/')}={v:.4g}" for k, v in sorted(metrics.items())),
        )

    async def _publish_step(self, c: _Consumed) -> None:
        if self.step < self.published:
            logger.info("version %d was published before the restart: not republished", self.step)
            return
        if self.step == self.published:  # the newest version before the restart, retrained: its old
            # weights may have died with the old learner (no worker fetched them); workers that hold
            # them see the new checksum and reload
            logger.warning("publishing version %d again: its weights were lost with the restart", self.step)
        await self._publish(c.metrics, c.batch_id)

    async def _publish(self, metrics: dict[str, float], batch_id: str = "") -> None:
        """Serve the current weights and publish their event, kept in Redis as the newest published version
        (one transaction, written once even when this publication is retried)."""
        event = await self._serve_weights(metrics, batch_id)
        mark = f"{event.version}@{self.life}"
        if not await self.ledger.publish(event, self.mark, mark):
            logger.warning(
                "version %d: its publication was written before (a retry): not published again", event.version
            )
        self.mark = mark
        self.published = event.version

    async def _serve_weights(self, metrics: dict[str, float], batch_id: str = "") -> WeightsPublished:
        started = time.perf_counter()
        path = self.cfg.weights_transport
        span = self.ctx.tracing.span(
            WEIGHTS_PUBLISH,
            weights_traceparent(self.cfg.run_id, self.step),
            attributes={POLICY_VERSION: self.step, STEP_INDEX: self.step, WEIGHTS_PATH: path},
        )
        params = self.group.full_weights() if self.adapter is None else self.group.adapter_weights()
        # returns once the transport holds this version (a broadcast then runs in the background)
        fields = await asyncio.to_thread(self.publisher.publish, params, self.step)
        span.set(NUM_BYTES, fields["num_bytes"])
        span.end()
        seconds = time.perf_counter() - started
        self.ctx.metrics.observe_weight_sync(seconds, path)
        metrics = {**metrics, "learner/weights_publish_s": seconds} if metrics else {}
        self.ctx.policy_version = self.step
        event = WeightsPublished(
            version=self.step,
            step=self.step,
            batch_id=batch_id,
            metrics=metrics,
            published_at=time.time(),
            **fields,
            payload="full" if self.adapter is None else "lora",
            lora=self.adapter,
        )
        return sign(event, self.weights_key, run_id=self.cfg.run_id)

    def _checkpoint(self, batch_id: str, metrics: dict[str, float], skipped: str) -> None:
        """Save the group's state after ``batch_id``'s step, with what its version's event needs should
        the learner die before the event is committed (see :meth:`run`)."""
        self.group.checkpoint(
            {
                "step": self.step,
                "next_index": self.next_index,
                "kl_coef": self.trainer.kl_ctl.value,
                "batch_id": batch_id,
                "metrics": {k: float(v) for k, v in metrics.items()},
                "skipped": skipped,
            }
        )
        self.checkpointed_step = self.step
        self.checkpointed_index = self.next_index

    async def _dead_letter(self, batch: Batch, entry_id: str, reason: str) -> None:
        """The dead letter of a batch consumed untrained (once per batch, even when replayed after a restart)."""
        payload = encode(batch)
        if len(payload) > self.ctx.bus.max_message_bytes // 2:  # the letter must fit: keep the batch's header
            payload = encode(_header(batch) if isinstance(batch, TrainingBatch) else _manifest_header(batch))
        unsigned = DeadLetter(
            stream=self.ctx.names.batches,
            entry_id=entry_id,
            group="learner",
            consumer="learner",
            error=f"{batch.id} ({_num_samples(batch)} samples) {BATCH_SKIPPED}: {reason}",
            deliveries=1,
            payload=payload,
            ts=time.time(),
        )
        letter = sign(unsigned, self.weights_key, run_id=self.cfg.run_id)  # the coordinator acts only on signed ones
        await self.ledger.dead_letter_once(batch.id, letter)

    async def _on_committed(self, entry_id: str, batch: Batch) -> None:
        """Acknowledge exactly the handled entries a checkpoint covers (index below the checkpointed one);
        the others stay pending, so a killed learner replays them after its last checkpoint."""
        reason = self.skipped.pop(batch.id, None)
        if reason is not None:
            await self._dead_letter(batch, entry_id, reason)
        # the hashes of this batch's samples (named under its id: never another batch's, whatever a copy names)
        keys = self.loaded_buffers.pop(batch.id, None) or (batch.buffers if isinstance(batch, BatchManifest) else [])
        payloads = owned_buffers(self.ctx.names, batch.id, keys, lanes=self.cfg.lanes.count)
        self.unacked.append((entry_id, batch.index, batch.id, payloads))
        covered = [u for u in self.unacked if u[1] < self.checkpointed_index]
        if covered:
            lost = [batch_id for index, batch_id in self.lost if index < self.checkpointed_index]
            await self.ledger.ack(
                self.ctx.names.batches,
                [e for e, _, _, _ in covered],
                [b for _, _, b, _ in covered] + lost,
                acked_from=self.acked_index,
                acked_index=self.checkpointed_index,
                payloads=[key for _, _, _, keys in covered for key in keys],
                lanes=self.lanes,
            )
            self.acked_index = self.checkpointed_index
            self.unacked = [u for u in self.unacked if u[1] >= self.checkpointed_index]
            self.lost = [x for x in self.lost if x[0] >= self.checkpointed_index]


def _header(batch: Batch) -> TrainingBatch:
    """``batch`` without its samples (what a dead letter keeps of a batch too large for it, or a skipped
    manifest's step span)."""
    return TrainingBatch(
        id=batch.id,
        index=batch.index,
        samples=[],
        policy_version=batch.policy_version,
        staleness=[],
        traceparent=batch.traceparent,
    )


def _manifest_header(manifest: BatchManifest) -> BatchManifest:
    """A manifest too large for a dead letter: its header (its sample hashes go with the learner's ack)."""
    return BatchManifest(
        id=manifest.id,
        index=manifest.index,
        samples=[],
        policy_version=manifest.policy_version,
        staleness=[],
        parts=manifest.parts,
        part_bytes=manifest.part_bytes,
    )


def _num_samples(batch: Batch) -> int:
    return batch.num_samples if isinstance(batch, BatchManifest) else len(batch.samples)
