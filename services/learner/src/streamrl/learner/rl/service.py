"""LearnerService: training batches in, new weights out.

* A consumer loop on ``batches`` (one at a time, in order). For batch ``k`` at step ``k``: train one
  step, serve the new weights (version ``k + 1``) from the ZMQ weight server, or with
  ``weights_transport = "ipc"`` copy them into the CUDA IPC buffers on the learner's GPU, or with
  ``"broadcast"`` into the buckets its weight group receives in the background, and publish
  WeightsPublished (version, checksum, endpoint / IPC buffers / group rendezvous, step metrics).
* Batches are acknowledged only once a checkpoint covers them (every ``checkpoint_every`` steps).
  A killed learner restarts from its last checkpoint and replays, in order, exactly the batches it
  had not checkpointed (they are still pending for it); batches older than the checkpoint are
  skipped by index, so none is trained on twice.
* Batches are trained strictly in index order. A batch ahead of the next index (from the future:
  forged, or a bug upstream) is dead-lettered with the reason and never trained. One behind it is
  skipped as already trained when it is a redelivery of an entry the learner held (a replay after
  a restart), and dead-lettered as a copy when it is delivered for the first time.
* Every failed step is counted in Redis per batch (so the count survives restarts). A step that
  fails before any backward pass is retried; one that fails after has left gradients or weights
  half-updated and is never retried in this process (a retry would train part of the batch twice):
  the learner stops with the error (exit 1), the batch still pending, and a restart resumes from the
  last checkpoint. A batch that failed ``consumer.max_deliveries`` times (or has no samples) is
  skipped: dead-lettered with its last error, and its version still published (the same weights),
  so versions keep counting batches and the coordinator's admission never waits for it.
* The last published event is kept in Redis (written atomically with it). A learner resumed from a
  checkpoint older than that version retrains the batches in between without republishing their
  versions, except the newest one: its weights died with the old learner if no worker had fetched
  them, so it is published again with the retrained weights (same version, another checksum;
  workers serving the lost weights reload) and the run goes on from there.
* At start the learner serves its current version (0, or the checkpoint's) so rollout workers know
  where to fetch weights; after the last step it exports the policy in Hugging Face format.
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
import time
from pathlib import Path

from streamrl.common.bus import Output
from streamrl.common.codec import decode, encode
from streamrl.common.consumer import ConsumerLoop
from streamrl.common.errors import PoisonMessageError
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import BATCH_SKIPPED, DeadLetter, TrainingBatch, WeightsPublished
from streamrl.common.trace_schema import NUM_BYTES, POLICY_VERSION, STEP_INDEX, WEIGHTS_PATH, WEIGHTS_PUBLISH
from streamrl.common.tracing import delivery_attempt, weights_traceparent
from streamrl.common.weights_auth import sign, weights_key
from streamrl.learner.rl.broadcast_weights import BroadcastWeightPublisher
from streamrl.learner.rl.config import LearnerConfig
from streamrl.learner.rl.group import LearnerGroup
from streamrl.learner.rl.ipc_weights import IpcWeightPublisher
from streamrl.learner.rl.traces import record_train_spans, start_step, step_figures, traced_rows
from streamrl.learner.rl.trainer import RLTrainer
from streamrl.learner.rl.weights import WeightServer

logger = logging.getLogger(__name__)


class LearnerService:
    """See the module docstring."""

    def __init__(self, config: LearnerConfig, ctx: ServiceContext, trainer: RLTrainer, group: LearnerGroup) -> None:
        self.cfg = config
        self.ctx = ctx
        self.trainer = trainer
        self.group = group
        self.step = 0
        self.next_index = 0
        """Index of the next batch to train (batches below it are replays)."""
        self.checkpointed_step = 0
        self.checkpointed_index = 0
        self.unacked: list[tuple[str, int]] = []
        """(entry id, batch index) of entries handled but not yet acknowledged."""
        self.server: WeightServer | None = None
        self.ipc: IpcWeightPublisher | None = None
        self.broadcast: BroadcastWeightPublisher | None = None
        self.weights_key = weights_key()
        """Signs every WeightsPublished (rollout workers with the key refuse events without it)."""
        if config.weights_transport == "ipc":
            self.ipc = IpcWeightPublisher(bucket_bytes=config.weights_bucket_mb * 2**20)
        if config.weights_transport == "broadcast":
            self.broadcast = BroadcastWeightPublisher.from_config(config)
        if config.weights_transport == "zmq" or (self.broadcast is not None and config.weights_zmq_fallback):
            self.server = WeightServer(
                host=config.weights_host, port=config.weights_port, advertise_host=config.weights_advertise_host,
                bucket_bytes=config.weights_bucket_mb * 2**20,
            )  # fmt: skip
        self.loop: ConsumerLoop[TrainingBatch] | None = None
        self.fatal: RuntimeError | None = None
        """Set when a step failed half-way: the service stops and ``run`` raises it."""
        self.published = -1
        """The newest version this run's learner published (kept in Redis across restarts)."""
        self.skipped: dict[str, str] = {}
        """Batch id -> reason, for skipped batches whose dead letter is written once they are committed."""
        self.num_skipped = 0

    def _state(self, name: str) -> str:
        return self.ctx.names.state(name)

    async def run(self) -> None:
        state = await asyncio.to_thread(self.group.resume)
        if state is not None:
            self.step = self.checkpointed_step = int(state["step"])
            self.next_index = self.checkpointed_index = int(state.get("next_index", self.step))
            logger.info("resumed from checkpoint at step %d", self.step)
        raw = await self.ctx.bus.redis.hget(self._state("learner"), "published")
        self.published = decode(raw, WeightsPublished).version if raw else -1
        if state is not None and self.step > self.published:
            # killed between the checkpoint and its version's commit: publish that step's event now,
            # naming its batch (the replayed entry is then skipped as trained) with the step's metrics
            logger.warning("version %d was checkpointed but not published before the restart: publishing it", self.step)
            if state.get("skipped"):
                self.skipped[state["batch_id"]] = state["skipped"]
            await self.ctx.bus.commit(await self._publish(dict(state.get("metrics", {})), state.get("batch_id", "")))
        elif self.step >= self.published:
            await self.ctx.bus.commit(await self._publish(metrics={}))
        else:
            logger.warning(
                "resumed at step %d, but versions up to %d were published before the restart: batches %d..%d "
                "are trained again, and only the last version is published again",
                self.step, self.published, self.next_index, self.next_index + self.published - self.step - 1,
            )  # fmt: skip
        self.loop = ConsumerLoop(
            self.ctx.bus, self.ctx.names, stream=self.ctx.names.batches, group="learner", consumer="learner",
            handler=self.handle, message_type=TrainingBatch, config=self.cfg.consumer.model_copy(
                # failures are counted per batch in Redis by ``handle`` (which skips a batch at the limit)
                update={"max_in_flight": 1, "count": 1, "max_deliveries": 2**31 - 1}
            ),
            ack=False, on_committed=self._on_committed,
            max_message_bytes=None,  # a batch is many trajectories, each checked against the limit
        )  # fmt: skip
        self.ctx.loops.append(self.loop)
        if self.cfg.redis.url is not None:  # always under service_main; tests may hand the service a bus
            self.ctx.metrics.watch_streams(self.cfg.redis.url, {"batches": self.ctx.names.batches})
        self.ctx.mark_running()
        try:
            await self.loop.run(self.ctx.stop, burst=self.ctx.burst)
        finally:
            if self.server is not None:
                self.server.close()
            if self.broadcast is not None:
                self.broadcast.close()
        if self.fatal is not None:
            raise self.fatal  # the other ranks, if any, die with this one
        await asyncio.to_thread(self.group.stop)  # not on an exception: the group then dies with this rank

    async def handle(self, batch: TrainingBatch) -> list[Output]:
        if batch.index < self.next_index:
            if delivery_attempt() <= 1:  # not a replay of an entry it held: a second copy of a trained batch
                raise PoisonMessageError(
                    f"{batch.id} is behind the learner, whose next batch is {self.next_index}: a copy of a "
                    "batch already trained, not trained again"
                )
            logger.info("skipping %s: already trained (next batch index %d)", batch.id, self.next_index)
            return []
        if batch.index > self.next_index:
            raise PoisonMessageError(
                f"{batch.id} is ahead of the learner, whose next batch is {self.next_index}: batches are "
                "never trained out of order"
            )
        failures = self._state(f"learner_failures:{batch.id}")
        failed = await self.ctx.bus.redis.hgetall(failures)
        if not batch.samples:
            return await self._skip(batch, "it has no samples")
        if int(failed.get(b"count", 0)) >= self.cfg.consumer.max_deliveries:
            error = failed.get(b"error", b"").decode()
            return await self._skip(batch, f"its step failed {int(failed[b'count'])} times, last: {error}")
        backward_calls = self.trainer.policy.backward_calls
        traced = traced_rows(batch)
        span = start_step(self.ctx.tracing, batch, traced, version=self.step)
        started = time.time()
        try:
            metrics = await asyncio.to_thread(self.group.step, batch)
        except Exception as e:
            span.fail(e)
            span.end()
            error = f"{type(e).__name__}: {e}"
            await self.ctx.bus.redis.hincrby(failures, "count", 1)
            await self.ctx.bus.redis.hset(failures, "error", error[:500])
            if self.trainer.policy.backward_calls == backward_calls:
                raise  # nothing trained yet: the consumer retries it (skipped above once at the limit)
            self.fatal = RuntimeError(
                f"{batch.id}: the step failed after training part of the batch ({error}); "
                "stopping: a restart resumes from the last checkpoint"
            )
            self.ctx.stop.set()
            raise asyncio.CancelledError(str(self.fatal)) from e  # leaves the batch pending, unretried
        ended = time.time()
        staleness = [self.step - s.trajectory.policy_version_start for s in batch.samples]
        metrics["learner/staleness_mean"] = sum(staleness) / len(staleness)
        metrics["learner/staleness_max"] = float(max(staleness))
        span.set_attributes(step_figures(metrics))
        record_train_spans(
            self.ctx.tracing, batch, traced, version=self.step, staleness=staleness,
            corrections=self.trainer.sample_corrections, start_s=started, end_s=ended,
        )  # fmt: skip
        span.end(ended)
        self.ctx.metrics.observe_staleness(staleness)
        self.ctx.metrics.count_samples("trained", len(batch.samples), int(metrics["learner/tokens"]))
        return await self._advance(batch, metrics)

    async def _skip(self, batch: TrainingBatch, reason: str) -> list[Output]:
        """Consume ``batch`` without training it: its version is published with unchanged weights."""
        logger.error("skipping %s untrained (its samples are dropped): %s", batch.id, reason)
        with start_step(self.ctx.tracing, batch, traced_rows(batch), version=self.step) as span:
            span.fail(f"{BATCH_SKIPPED}: {reason}")
        self.skipped[batch.id] = reason
        self.num_skipped += 1
        return await self._advance(batch, {"learner/batches_skipped": float(self.num_skipped)})

    async def _advance(self, batch: TrainingBatch, metrics: dict[str, float]) -> list[Output]:
        """Count ``batch`` as consumed: checkpoint / export when due, publish its version (unless a
        version this high was published before a restart)."""
        self.step += 1
        self.next_index = batch.index + 1
        if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.total_steps:
            await asyncio.to_thread(self._checkpoint, batch.id, metrics, self.skipped.get(batch.id, ""))
        if self.cfg.export_every and self.step % self.cfg.export_every == 0:
            await asyncio.to_thread(self.group.export, Path(self.cfg.run_dir) / "exports" / f"step-{self.step}")
        if self.step == self.cfg.total_steps:
            export = Path(self.cfg.export_dir or Path(self.cfg.run_dir) / "final")
            await asyncio.to_thread(self.group.export, export)
            logger.info("exported the final policy to %s", export)
        logger.info(
            "step %d: %s", self.step,
            " ".join(f"{k.removeprefix('learner/')}={v:.4g}" for k, v in sorted(metrics.items())),
        )  # fmt: skip
        if self.step < self.published:
            logger.info("version %d was published before the restart: not republished", self.step)
            return []
        if self.step == self.published:  # the newest version before the restart, retrained: its old
            # weights may have died with the old learner (no worker fetched them); workers that hold
            # them see the new checksum and reload
            logger.warning("publishing version %d again: its weights were lost with the restart", self.step)
        return await self._publish(metrics, batch.id)

    async def _publish(self, metrics: dict[str, float], batch_id: str = "") -> list[Output]:
        """The outputs that publish the current weights: the event, and the same event kept in Redis as
        the newest published version (one atomic commit)."""
        event = await self._serve_weights(metrics, batch_id)
        self.published = event.version
        return [
            Output(stream=self.ctx.names.weights, message=event),
            Output(key=self._state("learner"), field="published", message=event),
        ]

    async def _serve_weights(self, metrics: dict[str, float], batch_id: str = "") -> WeightsPublished:
        started = time.perf_counter()
        path = "ipc" if self.ipc is not None else "broadcast" if self.broadcast is not None else "zmq"
        span = self.ctx.tracing.span(
            WEIGHTS_PUBLISH, weights_traceparent(self.cfg.run_id, self.step),
            attributes={POLICY_VERSION: self.step, STEP_INDEX: self.step, WEIGHTS_PATH: path},
        )  # fmt: skip
        params = self.group.full_weights()
        ipc = broadcast = None
        endpoint = ""
        if self.ipc is not None:
            ipc, checksum = await asyncio.to_thread(self.ipc.publish, params, self.step)
            num_bytes, num_buckets = self.ipc.num_bytes, self.ipc.num_buffers
        elif self.broadcast is not None:
            # returns once the buckets hold this version; the group receives them in the background
            broadcast, checksum = await asyncio.to_thread(self.broadcast.publish, params, self.step)
            num_bytes, num_buckets = self.broadcast.num_bytes, self.broadcast.num_buckets
            if self.server is not None:  # the ZMQ fallback: the event's checksum is then the ZMQ one
                checksum, _, _ = await asyncio.to_thread(self.server.publish, self.broadcast.tensors(), self.step)
                endpoint = self.server.endpoint
        else:
            assert self.server is not None
            checksum, num_bytes, num_buckets = await asyncio.to_thread(self.server.publish, params, self.step)
            endpoint = self.server.endpoint
        span.set(NUM_BYTES, num_bytes)
        span.end()
        seconds = time.perf_counter() - started
        self.ctx.metrics.observe_weight_sync(seconds, path)
        metrics = {**metrics, "learner/weights_publish_s": seconds} if metrics else {}
        self.ctx.policy_version = self.step
        event = WeightsPublished(
            version=self.step, step=self.step, batch_id=batch_id, checksum=checksum, num_bytes=num_bytes,
            num_buckets=num_buckets, endpoint=endpoint, metrics=metrics, published_at=time.time(), ipc=ipc,
            broadcast=broadcast,
        )  # fmt: skip
        return sign(event, self.weights_key, run_id=self.cfg.run_id)

    def _checkpoint(self, batch_id: str, metrics: dict[str, float], skipped: str) -> None:
        """Save the group's state after ``batch_id``'s step, with what its version's event needs should
        the learner die before the event is committed (see :meth:`run`)."""
        self.group.checkpoint({
            "step": self.step, "next_index": self.next_index, "kl_coef": self.trainer.kl_ctl.value,
            "batch_id": batch_id, "metrics": {k: float(v) for k, v in metrics.items()}, "skipped": skipped,
        })  # fmt: skip
        self.checkpointed_step = self.step
        self.checkpointed_index = self.next_index

    async def _on_committed(self, entry_id: str, batch: TrainingBatch) -> None:
        """Acknowledge exactly the handled entries a checkpoint covers (index below the checkpointed one);
        the others stay pending, so a killed learner replays them after its last checkpoint."""
        reason = self.skipped.pop(batch.id, None)
        if reason is not None and await self.ctx.bus.redis.set(self._state(f"learner_dead:{batch.id}"), 1, nx=True):
            payload = encode(batch)
            if len(payload) > self.ctx.bus.max_message_bytes // 2:  # the letter must fit: keep the batch's header
                header = TrainingBatch(
                    id=batch.id, index=batch.index, samples=[], policy_version=batch.policy_version, staleness=[]
                )
                payload = encode(header)
            letter = DeadLetter(
                stream=self.ctx.names.batches, entry_id=entry_id, group="learner", consumer="learner",
                error=f"{batch.id} ({len(batch.samples)} samples) {BATCH_SKIPPED}: {reason}", deliveries=1,
                payload=payload, ts=time.time(),
            )  # fmt: skip
            await self.ctx.bus.publish(self.ctx.names.dead, letter)  # once, even when replayed after a restart
        self.unacked.append((entry_id, batch.index))
        covered = [entry for entry, index in self.unacked if index < self.checkpointed_index]
        if covered:
            await self.ctx.bus.redis.xack(self.ctx.names.batches, "learner", *covered)
            self.unacked = [(entry, index) for entry, index in self.unacked if index >= self.checkpointed_index]
