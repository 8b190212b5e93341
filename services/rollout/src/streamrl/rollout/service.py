"""RolloutService: prompts in, trajectories out, weights kept at the version the prompts ask for.

* A consumer loop on ``prompts``: for each PromptWorkItem, wait until the engine serves at least
  the prompt's policy version, generate ``n`` samples, write each sample's Trajectory once as a payload
  (plain pipelined SETs under ``payload:{trajectory id}:{attempt}``, with ``redis.payload_orphan_ttl_s`` to
  live, :mod:`streamrl.common.payloads`), then commit one small TrajectoryRecord per sample naming it (the
  records, the PERSIST of their payloads and the ack are one atomic step, de-duplicated by the work item
  id; a payload of a delivery that never commits expires). Many prompts are in
  flight at once (``consumer.max_in_flight``); the engine batches them. A prompt waiting for a
  version not served yet (issued ahead, ``coordinator.prefetch_steps``) is parked: it holds no
  in-flight slot while it waits, so a prompt that can run now - the replacement of a filtered or
  failed group, owed the current version - is still read and generated, however many wait; once
  their version lands the waiting prompts take slots again in the order they came.
* A tail of ``weights``: every WeightsPublished newer than what the engine serves is handed to the
  engine, whose receiver - the one the event's ``transport`` tag picks (:mod:`streamrl.torchkit.weights`:
  the learner's ZMQ server, its CUDA IPC buffers when colocated, or a member of its broadcast group,
  falling back to ZMQ when the engine cannot join and the learner serves one; or the weight relay, whose
  upstreams this worker picks from the live workers' heartbeats, :mod:`streamrl.rollout.weights.relay_seat`) -
  fetches it with a deadline; then it is loaded. Every path loads exactly the signed event's version and checks the
  weights against its checksum (over the broadcast too: a member refuses whatever else the group's
  unauthenticated store offers, and a version replaced by a newer one before it was loaded waits
  for that one's event). The follower reads on while a version loads: a newer event - a newer version, or
  this one published again by a restarted learner whose old endpoint may be dead - abandons the update
  in progress (``WeightUpdate.abandoned``: its fetch stops) and takes its place; a failed sync is retried every
  ``WEIGHT_RETRY_S``. The version the engine serves is reported in the heartbeat and in the
  ``served`` hash. A worker that joins late
  loads the latest published version before it takes prompts. In a LoRA run a version is the
  adapter alone (``payload = "lora"``): the engine adds it to the base it was built from.
* With ``rollout.engine.sleep_between_versions`` (colocated synchronous runs: ``streamrl up`` checks
  ``coordinator.max_staleness = 0`` and ``learner.weights_transport = "ipc"``) the engine sleeps
  when it has no work left: no prompt in the engine for ``SLEEP_IDLE_S`` - the current version's
  groups are done and the learner trains on them, on the same GPU. When the next version's weights
  arrive it is woken, then updated, then the prompts waiting for that version generate. A prompt
  that arrives while it sleeps (a replacement owed the current version) wakes it too (the engine
  wakes itself before it generates).
* With ``rollout.environment`` set, each sample is a multi-turn episode with that environment
  (:mod:`streamrl.rollout.environments.episode`): the Trajectory then carries the turns, the loss mask (0 on the
  environment's tokens), the stop reason and - when the environment failed - ``metadata["env_error"]``.
* A prompt's images go to the engine with its prompt (one image token per image); the Trajectory
  records the prompt as the model saw it (image tokens expanded, as the engine reports it) and every
  image in order: the prompt's, then those an environment returned.

Observability (:mod:`streamrl.common.telemetry.tracing`, :mod:`streamrl.common.telemetry.prom`): per prompt a
``rollout.queue`` span from its issue to the start of its generation (under the prompt's
traceparent), under it one ``rollout.generate`` span per sample whose traceparent the Trajectory
carries; per version a worker loads a ``rollout.weights_load`` span under that version's weights
context. Spans of a prompt whose trace was not sampled cost a null object each; nothing is done per
token. Metrics: samples and tokens generated, prompts waiting in or running on the engine, weight
sync seconds per path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import numpy as np

from streamrl.common.aio import cancel_and_wait, timeout
from streamrl.common.bus import Output
from streamrl.common.codec import decode
from streamrl.common.consumer import ConsumerLoop
from streamrl.common.errors import PoisonMessageError, RetryableError, WeightSyncError
from streamrl.common.follower import StreamFollower, previous_id, supervise
from streamrl.common.lanes import home_run_id
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import PromptWorkItem, Tensor, Trajectory, WeightsPublished
from streamrl.common.payloads import store_payloads
from streamrl.common.replies import entries as stream_entries
from streamrl.common.telemetry.trace_schema import (
    ENGINE,
    FINISH_REASON,
    GENERATE,
    GROUP_ID,
    NUM_BYTES,
    NUM_PROMPT_TOKENS,
    NUM_RESPONSE_TOKENS,
    PARTIAL,
    POLICY_VERSION,
    QUEUE,
    TRAJECTORY_ID,
    VERSION_END,
    VERSION_START,
    VERSIONS,
    WEIGHTS_LOAD,
    WEIGHTS_PATH,
)
from streamrl.common.telemetry.tracing import weights_traceparent
from streamrl.common.weights.auth import KEY_ENV, check, weights_key
from streamrl.rollout.agents.conversation import AgentEpisode
from streamrl.rollout.agents.gateway import AgentGateway
from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.engines.engine import Engine, GenerationRequest, Sample
from streamrl.rollout.environments.episode import Episode, EpisodeRunner
from streamrl.rollout.weights.relay_seat import WorkerRelay

logger = logging.getLogger(__name__)
ENGINE_CLOSE_TIMEOUT_S = 10.0
WEIGHT_RETRY_S = 1.0
"""Pause between two tries of a weight update whose sync failed (a newer event abandons it meanwhile)."""
SLEEP_IDLE_S = 0.2
"""With ``sleep_between_versions``: how long the engine must have had no prompt before it sleeps (prompts
of one version arrive in reads of a few; this keeps it from sleeping between two of them)."""


class RolloutService:
    """See the module docstring."""

    def __init__(
        self,
        config: RolloutConfig,
        ctx: ServiceContext,
        engine: Engine,
        episodes: EpisodeRunner | AgentGateway | None = None,
    ) -> None:
        self.cfg = config
        self.ctx = ctx
        self.redis = ctx.bus.redis
        self.engine = engine
        self.episodes = episodes
        """Runs each sample as a multi-turn episode (``rollout.environment``) or hands it to an external
        agent (``rollout.agent``); None = one completion each."""
        self.latest: WeightsPublished | None = None
        self.changed = asyncio.Condition()
        self.update_lock = asyncio.Lock()
        self.served_checksum: str | None = None
        """Checksum of the weights the engine serves, None while they are the model's own (not loaded)."""
        self.weights_key = weights_key()
        self.in_engine = 0
        """Prompts waiting in or running on the engine now (``streamrl_engine_queue_depth``)."""
        self.idle_since = 0.0
        """When the last prompt left the engine (``time.monotonic()``)."""
        self.sleeper: asyncio.Task[None] | None = None
        """Puts the engine to sleep once it has been idle for SLEEP_IDLE_S (``sleep_between_versions``)."""
        self.updating: tuple[WeightsPublished, asyncio.Task[None]] | None = None
        """The weights event being loaded and the task loading it (:meth:`_on_weights`)."""
        self.loop: ConsumerLoop[PromptWorkItem] | None = None
        """The consumer loop on ``prompts`` (set by :meth:`run`): prompts park in it while they wait for weights."""
        self.relay = WorkerRelay(config, ctx)
        """This worker's relay node and upstreams on the ``relay`` transport (made at the first relay event)."""
        if self.weights_key is None:
            logger.warning(
                "weights events are not authenticated (%s is not set): any writer to the weights "
                "stream can point this worker at other weights",
                KEY_ENV,
            )

    async def run(self) -> None:
        cursor = await self._load_latest_weights()
        loop: ConsumerLoop[PromptWorkItem] = ConsumerLoop(
            self.ctx.bus,
            self.ctx.names,
            stream=self.ctx.names.prompts,
            group="rollout",
            consumer=self.ctx.instance,
            handler=self.handle,
            message_type=PromptWorkItem,
            config=self.cfg.consumer,
        )
        self.loop = loop
        self.ctx.loops.append(loop)
        self.ctx.mark_running()
        tail = asyncio.create_task(self._tail_weights(cursor))
        # a worker whose follower died must not serve stale weights with a healthy heartbeat: stop it
        # (``run`` then raises, so the process exits non-zero)
        supervise(tail, "the weight follower", lambda _: self.ctx.stop.set())
        try:
            await loop.run(self.ctx.stop, burst=self.ctx.burst)
            for what, task in (("the weight follower", tail), ("the weight update", self._update_task())):
                if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
                    raise RuntimeError(f"{what} died: {task.exception()!r}") from task.exception()
        finally:
            # an update in progress is abandoned: its fetch stops, and the engine closes without waiting for it
            tasks = [tail, self._update_task(), self.sleeper]
            await cancel_and_wait([t for t in tasks if t is not None])
            await self.redis.hdel(self.ctx.names.served_versions, self.ctx.instance)
            self.relay.close()
            try:
                async with timeout(ENGINE_CLOSE_TIMEOUT_S):
                    await asyncio.to_thread(self.engine.close)
            except TimeoutError:
                logger.error("the engine did not close within %.0f s", ENGINE_CLOSE_TIMEOUT_S)

    async def handle(self, item: PromptWorkItem) -> list[Output]:
        if self.engine.version < item.policy_version:  # its slot goes to prompts that can run meanwhile
            async with self.loop.parked() if self.loop is not None else contextlib.nullcontext():
                await self._wait_for_version(item.policy_version)
        tracing = self.ctx.tracing
        started = time.time()
        queued = tracing.record(
            QUEUE, item.traceparent, start_s=item.issued_at, end_s=started, attributes={GROUP_ID: item.id}
        )
        request = GenerationRequest(
            prompt_ids=item.prompt_ids.tolist(), sampling=item.sampling, images=list(item.images)
        )
        # a span not recorded passes its parent's traceparent on: tracing is off or this trace was left
        # out, and the samples' spans would record nothing either (skipping them saves ~4 us a sample)
        traced = queued != item.traceparent
        with contextlib.ExitStack() as stack:  # an engine error fails every sample's span
            n = request.sampling.n if traced else 0
            spans = [stack.enter_context(tracing.span(GENERATE, queued, start_s=started)) for _ in range(n)]
            samples: Sequence[Sample | Episode] = await (
                self._generate(request) if self.episodes is None else self._run_episodes(item)
            )
            ended = time.time()
            for j, (sample, span) in enumerate(zip(samples, spans, strict=traced)):
                span.set_attributes(
                    {
                        TRAJECTORY_ID: f"{item.id}/{j}",
                        ENGINE: self.cfg.engine.type,
                        VERSION_START: sample.version_start,
                        VERSION_END: sample.version_end,
                        PARTIAL: sample.version_start != sample.version_end,
                        NUM_PROMPT_TOKENS: len(request.prompt_ids),
                        NUM_RESPONSE_TOKENS: len(sample.token_ids),
                        FINISH_REASON: sample.finish_reason,
                    }
                )
                if sample.versions:
                    span.set(VERSIONS, ",".join(f"{i}:{v}" for i, v in sample.versions))
                span.end(ended)
        self.ctx.metrics.count_samples("generated", len(samples), sum(_num_generated(x) for x in samples))
        timings = {"queue_s": max(0.0, started - item.issued_at), "generate_s": ended - started, "started_at": started}
        traceparents = [span.traceparent for span in spans] if traced else [queued] * len(samples)
        trajectories = [
            _trajectory(item, j, sample, timings, traceparent)
            for j, (sample, traceparent) in enumerate(zip(samples, traceparents, strict=True))
        ]
        return await store_payloads(self.ctx.bus, self.ctx.names, trajectories)

    async def _generate(self, request: GenerationRequest) -> list[Sample]:
        """The samples of one prompt, counted in the engine queue depth while they are generated."""
        metrics = self.ctx.metrics
        self.in_engine += 1
        metrics.set_engine_queue_depth(self.in_engine)
        try:
            (samples,) = await self.engine.generate([request])
        finally:
            self._left_engine()
        return samples

    async def _run_episodes(self, item: PromptWorkItem) -> list[Episode]:
        """The episodes of one prompt, counted in the engine queue depth while they run."""
        assert self.episodes is not None
        metrics = self.ctx.metrics
        self.in_engine += 1
        metrics.set_engine_queue_depth(self.in_engine)
        try:
            return await self.episodes.run_group(item)
        finally:
            self._left_engine()

    def _left_engine(self) -> None:
        """A prompt is done with the engine; the last one starts the idle timer of the sleep policy."""
        self.in_engine -= 1
        self.ctx.metrics.set_engine_queue_depth(self.in_engine)
        if self.cfg.engine.sleep_between_versions and self.in_engine == 0:
            self.idle_since = time.monotonic()
            if self.sleeper is None or self.sleeper.done():
                self.sleeper = asyncio.create_task(self._sleep_when_idle())

    async def _sleep_when_idle(self) -> None:
        """Sleep the engine once no prompt has been in it for SLEEP_IDLE_S and no update is loading."""
        while (left := self.idle_since + SLEEP_IDLE_S - time.monotonic()) > 0:
            await asyncio.sleep(left)
        if self.in_engine or self.update_lock.locked() or self.engine.asleep:
            return
        try:
            seconds = await self.engine.sleep()
        except Exception:  # the engine stays awake and serves on; its own errors surface in generate
            logger.exception("the engine could not sleep")
            return
        logger.info("engine asleep at policy version %d (%.0f ms)", self.engine.version, seconds * 1e3)

    async def _wait_for_version(self, version: int) -> None:
        """Block until the engine serves ``version`` or newer (pulling it if it is published)."""
        if self.engine.version >= version:
            return
        deadline = time.monotonic() + self.cfg.version_wait_s
        async with self.changed:
            while self.engine.version < version:
                if self.ctx.stop.is_set():  # stopping: leave the prompt pending for whoever serves next
                    raise asyncio.CancelledError(f"stopping while waiting for policy version {version}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RetryableError(f"policy version {version} not served after {self.cfg.version_wait_s} s")
                try:
                    async with timeout(min(remaining, 1.0)):
                        await self.changed.wait()
                except TimeoutError:
                    pass

    async def _load_latest_weights(self) -> str:
        """Load the newest published weights (late joiners); returns the stream cursor to follow from:
        after it, or just before it when loading failed (the follower then retries it, or takes a
        newer version, while the worker runs: prompts for newer versions wait for it)."""
        last = stream_entries(await self.redis.xrevrange(self.ctx.names.weights, count=16))
        for entry_id, fields in last:
            try:
                msg = self._weights_event(fields)
            except PoisonMessageError as e:
                logger.error("skipping weights entry %s: %s", entry_id.decode(), e)
                continue
            try:
                await self._apply(msg)
            except WeightSyncError as e:
                logger.error(
                    "joining: loading policy version %d failed (%s); the weight follower retries it", msg.version, e
                )
                self._report(self.engine.version)
                return previous_id(entry_id.decode())
            return str(last[0][0].decode())
        self._report(self.engine.version)
        return str(last[0][0].decode()) if last else "0-0"

    def _weights_event(self, fields: dict[bytes, bytes]) -> WeightsPublished:
        """A weights stream entry, decoded and its signature checked (PoisonMessageError: never apply it)."""
        event = decode(fields.get(b"d", b""), WeightsPublished)
        check(event, self.weights_key, run_id=home_run_id(self.ctx.names.run_id))
        return event

    async def _tail_weights(self, cursor: str) -> None:
        follower = StreamFollower(self.redis, self.ctx.names.weights, self._weights_event, self._on_weights, count=16)
        await follower.run(cursor)

    async def _on_weights(self, entries: list[tuple[str, WeightsPublished]], last_id: str) -> str:
        """Take the newest event of a read: its update runs while the follower reads on, and a newer event - a
        newer version, or this version published again by a restarted learner (whose old endpoint may be dead) -
        abandons it and takes its place."""
        if not entries:
            return last_id
        entry_id, newest = entries[-1]
        if self.updating is not None and not self.updating[1].done():
            taking, task = self.updating
            if newest.version < taking.version or newest == taking:
                return last_id
            logger.warning(
                "abandoning the weight update to version %d: a newer weights event (version %d) is published",
                taking.version,
                newest.version,
            )
            await cancel_and_wait([task])
        task = asyncio.create_task(self._update_until_loaded(entry_id, newest))
        # a worker whose update failed for another reason than the sync (the engine broke) must stop too
        supervise(task, f"the weight update to version {newest.version}", lambda _: self.ctx.stop.set())
        self.updating = (newest, task)
        return last_id

    async def _update_until_loaded(self, entry_id: str, msg: WeightsPublished) -> None:
        """Apply ``msg`` (entry ``entry_id``), again every ``WEIGHT_RETRY_S`` while the sync fails, until it is
        loaded, abandoned, or superseded by a newer event (which the follower takes next)."""
        while True:
            try:
                await self._apply(msg)
                return
            except WeightSyncError as e:
                if await self._superseded(entry_id, msg.version):
                    logger.warning(
                        "weight sync to version %d failed (%s); a newer weights event is published: taking that",
                        msg.version,
                        e,
                    )
                    return
                logger.error("weight sync to version %d failed: %s", msg.version, e)
            await asyncio.sleep(WEIGHT_RETRY_S)

    async def _superseded(self, entry_id: str, version: int) -> bool:
        """Whether a valid event of ``version`` or newer follows entry ``entry_id`` (the follower takes it next)."""
        for newer_id, fields in stream_entries(await self.redis.xrevrange(self.ctx.names.weights, count=16)):
            if _stream_order(newer_id.decode()) <= _stream_order(entry_id):
                return False
            try:
                if self._weights_event(fields).version >= version:
                    return True
            except PoisonMessageError:
                continue
        return False

    async def _apply(self, msg: WeightsPublished) -> None:
        async with self.update_lock:
            if msg.version < self.engine.version:
                return
            # the same version again: the same weights, unless a restarted learner republished it
            # with weights retrained from its checkpoint (another checksum): then reload
            if msg.version == self.engine.version and self.served_checksum in (None, msg.checksum):
                return
            started = time.perf_counter()
            parent = weights_traceparent(self.cfg.run_id, msg.version)
            attributes = {POLICY_VERSION: msg.version, NUM_BYTES: msg.num_bytes}
            with self.ctx.tracing.span(WEIGHTS_LOAD, parent, attributes=attributes) as span:
                if self.cfg.engine.sleep_between_versions and self.engine.asleep:  # wake, update, generate
                    woke = await self.engine.wake()
                    logger.info("engine awake for policy version %d (%.0f ms)", msg.version, woke * 1e3)
                path = msg.transport
                await self.relay.prepare(msg)  # the relay's upstreams, from the registry (other transports: none)
                await self.engine.update_weights(msg, self.cfg.weight_sync_timeout_s)
                version = self.engine.version
                self.served_checksum = msg.checksum if version == msg.version else None
                span.set_attributes({POLICY_VERSION: version, WEIGHTS_PATH: path})
            seconds = time.perf_counter() - started
            self.ctx.metrics.observe_weight_sync(seconds, path)
            logger.info("now serving policy version %d (sync took %.0f ms over %s)", version, seconds * 1e3, path)
        self._report(version)
        await self.redis.hset(self.ctx.names.served_versions, self.ctx.instance, version)
        async with self.changed:
            self.changed.notify_all()

    def _update_task(self) -> asyncio.Task[None] | None:
        return None if self.updating is None else self.updating[1]

    def _report(self, version: int) -> None:
        self.ctx.policy_version = version


def _stream_order(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq or 0)


def _num_generated(sample: Sample | Episode) -> int:
    """Tokens the model generated (an episode's environment tokens are not counted)."""
    return len(sample.token_ids) if isinstance(sample, Sample) else sample.num_model_tokens


def _trajectory(
    item: PromptWorkItem, j: int, sample: Sample | Episode, timings: dict[str, float], traceparent: str
) -> Trajectory:
    """Sample (or episode) ``j`` of ``item`` as the message to the reward tier."""
    if isinstance(sample, Sample):
        loss_mask, turns, stop_reason, metadata = np.ones(len(sample.token_ids), dtype=np.uint8), [], "", item.metadata
    else:
        loss_mask, turns, stop_reason = np.asarray(sample.loss_mask, dtype=np.uint8), sample.turns, sample.stop_reason
        metadata = {**item.metadata, "env_info": sample.env_infos}
        if sample.env_error is not None:
            metadata["env_error"] = sample.env_error
    prompt_ids, prompt_text, images = item.prompt_ids, item.prompt_text, item.images
    if sample.prompt_ids is not None:  # the prompt had images: as the model saw them (expanded)
        prompt_ids = Tensor.from_numpy(np.asarray(sample.prompt_ids, dtype=np.int32))
    if isinstance(sample, Episode) and sample.images:
        images = [*item.images, *sample.images]
    if isinstance(sample, AgentEpisode):  # the agent's conversation has its own prompt
        prompt_ids = Tensor.from_numpy(np.asarray(sample.prompt_ids, dtype=np.int32))
        prompt_text, metadata["agent_reward"] = sample.prompt_text, sample.reward
    return Trajectory(
        id=f"{item.id}/{j}",
        group_id=item.id,
        group_index=j,
        group_size=item.sampling.n,
        prompt_ids=prompt_ids,
        response_ids=Tensor.from_numpy(np.asarray(sample.token_ids, dtype=np.int32)),
        logprobs=Tensor.from_numpy(np.asarray(sample.logprobs, dtype=np.float32)),
        loss_mask=Tensor.from_numpy(loss_mask),
        prompt_text=prompt_text,
        response_text=sample.text,
        finish_reason=sample.finish_reason,
        truncated=sample.truncated,
        sampling=item.sampling,
        policy_version_start=sample.version_start,
        policy_version_end=sample.version_end,
        policy_versions=list(sample.versions),
        label=item.label,
        metadata=metadata,
        images=images,
        is_eval=item.is_eval,
        timings=dict(timings),
        traceparent=traceparent,
        turns=turns,
        stop_reason=stop_reason,
    )
