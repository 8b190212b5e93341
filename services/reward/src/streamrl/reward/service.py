"""The reward service's handler: TrajectoryRecord in, one small ScoredRecord out to the scored stream.

    consumer loop (streamrl.common.consumer) --handle(record)--> payload fetch --> MicroBatcher --batch--> scorers
                                                                                         |  (concurrently)
    Output(names.scored, ScoredRecord) <-- combine (weights) <---------------------------+

The record names its payload (the Trajectory the rollout worker stored once); concurrent handles fetch
their payloads together (a MicroBatcher of fetches: pipelined reads, replies of at most
``redis.max_command_mb``, :func:`streamrl.common.payloads.read_payloads`). Only the payload's head is read
(``GETRANGE``: the Trajectory without its tensors and images, whose tensors are then empty: text, label,
metadata, turns - all the reward functions, remote reward services and text reward models read) unless a
scorer reads token ids (``Scorer.reads_tokens``: a reward model with ``input = "token_ids"``, built from the
config or passed in): then the whole payload (:mod:`streamrl.common.payload_format`). A
payload of format 1 (a record without ``payload_head_bytes``) is read whole. The ScoredRecord carries the
record, the reward and the scoring's provenance, never the tokens. A payload that is gone fails the delivery
(retried, then dead-lettered naming the key): nothing is ever scored without its trajectory. A whole
Trajectory on the stream (the first form of the contract, or a tool writing one) is still scored, into a whole
ScoredTrajectory.

Concurrent ``handle`` calls (the loop runs up to ``max_in_flight`` at once) are grouped into
micro-batches, so every scorer sees batches, not single samples. A scorer that fails raises
``ScorerError`` with the reason: the loop retries the entry and finally dead-letters it with that
reason; nothing is ever scored 0 by default. When a batch fails for a reason that may be
sample-specific (a user function raised, answered a list of the wrong length), its trajectories are
re-scored one by one so only the bad one fails. A scorer answer that is unusable for some samples
only (NaN, infinite, not a number: :meth:`ScorerResult.problem`) fails those samples alone with the
reason (``reward.on_invalid = "dead_letter"``), or scores them ``reward.invalid_value`` (``"score"``:
counted in ``reward/invalid``, logged once per ``INVALID_LOG_EVERY``); their neighbours are scored.
De-duplication by trajectory id is the loop's job.

Multi-turn episodes (``Trajectory.turns``): the scorers give the final (outcome) reward, and the
environment gave one after each turn (``Turn.reward``). ``turn_rewards`` is the environment's rewards
with the final reward added to the last turn's, and ``reward`` their sum: the whole return, which the
learner's outcome estimators use; its token-level ones credit each turn's reward at that turn's end
(docs/multiturn.md). ``score`` stays the scorers' (0-1, for accuracy and dynamic filtering).

Per trajectory, the ScoredTrajectory carries the figures of its scoring (averaged per batch by the
coordinator, like every ``extra`` key): ``reward_latency_ms`` (this delivery's wait for its
scores), ``extra["reward/attempts"]`` (backend calls it took in this instance, counting those of
earlier deliveries that failed, and of a batch that failed before it was scored alone) and
``extra["reward/retried"]`` (1.0 when that is more than one).

On stop, ``close`` cancels the calls still waiting for scores: their entries stay pending for the
next consumer; they never fail with a reason that only says the service was stopping.

A permanent error (:class:`PermanentScorerError`: the backend refused the token, or stayed unreachable past every
retry) does not fail the delivery: the worker pauses its intake and probes until the backend accepts again
(:mod:`streamrl.reward.pause`); ``on_pause`` hears the cause (the heartbeat says ``paused`` with it) and ``""`` once
scoring resumes.

A scorer that can score nothing more - a synchronous reward function whose threads are all held by
calls that timed out (:mod:`streamrl.reward.threads`) - sets ``failure`` and ``failed``: the worker
(``__main__``) then stops, leaves what it holds pending and exits non-zero, to be restarted, rather
than heartbeat while scoring nothing.

Observability: each delivery of a trajectory is one ``reward.score`` span under the trajectory's
traceparent (a redelivery's span is a sibling, ``streamrl.attempt`` tells them apart); it carries the
provenance, the reward, the retries (``reward/attempts`` - 1) and ``reward_latency_ms``, and is
marked failed when the delivery fails; the ScoredTrajectory carries its traceparent, so only the
delivery that committed has children. Each scorer call on a micro-batch is observed in the
Prometheus metrics by scorer name: its latency, the backend calls it retried, whether it failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from streamrl.common.aio import cancel_and_wait
from streamrl.common.bus import Output
from streamrl.common.messages import ScoredRecord, Trajectory, TrajectoryRecord
from streamrl.common.payload_format import unpack_head, unpack_payload
from streamrl.common.payloads import assemble, read_payloads, record_of
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.prom import NULL_METRICS, Metrics
from streamrl.common.telemetry.trace_schema import (
    REMOTE_LATENCY_MS,
    RETRIES,
    REWARD,
    REWARD_VALUE,
    SCORER,
    TRAJECTORY_ID,
)
from streamrl.common.telemetry.tracing import NULL_TRACING, Tracing
from streamrl.reward.batcher import MicroBatcher
from streamrl.reward.combine import CombinedScore, WeightedResult, combine
from streamrl.reward.config import RewardConfig
from streamrl.reward.pause import IntakePause
from streamrl.reward.scorers import PermanentScorerError, Scorer, ScorerError, ScorerResult, build_scorer

logger = logging.getLogger(__name__)

MAX_TRACKED_FAILURES = 100_000
"""Trajectories whose failed attempts are remembered for ``reward/attempts`` (the oldest are forgotten:
entries that were dead-lettered never come back to claim theirs)."""


def episode_rewards(trajectory: Trajectory, final_reward: float) -> list[float]:
    """Per-turn rewards of a multi-turn episode: each turn's environment reward, the scorers'
    ``final_reward`` added to the last; ``[]`` for a single prompt and completion."""
    rewards = [turn.reward for turn in trajectory.turns]
    if rewards:
        rewards[-1] += final_reward
    return rewards


INVALID_LOG_EVERY = 100
"""With ``reward.on_invalid = "score"``, one line is logged for the first invalid sample and every this many."""

FETCH_WAIT_MS = 1.0
"""How long a payload fetch waits for concurrent ones to share its pipeline (ms)."""


class MissingPayloadError(RuntimeError):
    """A record's payload is not in Redis (expired before its commit, or deleted): it cannot be scored."""


class PayloadSource(Protocol):
    """Where the reward tier reads the payloads records name: whole (``whole``) or only their heads."""

    async def fetch(self, records: list[TrajectoryRecord], whole: bool) -> list[Trajectory]: ...


class RedisPayloads:
    """Payloads read from Redis in bounded pipelines of GETRANGE (heads) or GET (whole, or of format 1); a
    missing one fails its record alone."""

    def __init__(self, redis: object, max_reply_bytes: int) -> None:
        self.redis = redis
        self.max_reply_bytes = max_reply_bytes

    async def fetch(self, records: list[TrajectoryRecord], whole: bool) -> list[Trajectory]:
        prefixes = [0 if whole else r.payload_head_bytes for r in records]
        raw = await read_payloads(
            self.redis,
            [r.payload_key for r in records],
            [r.payload_bytes for r in records],
            max_reply_bytes=self.max_reply_bytes,
            prefixes=prefixes,
        )
        missing = [r for r, p in zip(records, raw, strict=True) if p is None]
        if missing:
            raise MissingPayloadError(
                f"payload {missing[0].payload_key} of trajectory {missing[0].id} is not in Redis "
                f"({len(missing)} of {len(records)} fetched together missing): expired or deleted"
            )
        return [unpack_head(p) if n else unpack_payload(p) for p, n in zip(raw, prefixes, strict=True) if p is not None]


def _is_sample_specific(error: BaseException) -> bool:
    return isinstance(error, ScorerError) and error.sample_specific


def _is_missing(error: BaseException) -> bool:
    """A fetch that found a payload missing is retried one record at a time: only that record fails."""
    return isinstance(error, MissingPayloadError)


class RewardService:
    """Scores trajectories with the configured scorers; ``handle`` is the consumer-loop handler.

    Example:
        service = RewardService(config, StreamNames(run_id))
        loop = ConsumerLoop(bus, names, stream=names.trajectories, group="reward", consumer=instance,
                            handler=service.handle, message_type=Trajectory, config=consumer_config)
    """

    def __init__(
        self,
        config: RewardConfig,
        names: StreamNames,
        scorers: Sequence[Scorer] | None = None,
        *,
        tracing: Tracing = NULL_TRACING,
        metrics: Metrics = NULL_METRICS,
        payloads: PayloadSource | None = None,
        on_pause: Callable[[str], None] | None = None,
    ) -> None:
        self._names = names
        self._payloads = payloads
        self._fetcher: MicroBatcher[TrajectoryRecord, Trajectory] = MicroBatcher(
            self._fetch_batch, config.max_batch_size, FETCH_WAIT_MS, split_on=_is_missing
        )
        self._tracing = tracing
        self._metrics = metrics
        self.failure: str | None = None
        """Why a scorer can score nothing more (the worker must be restarted); None while all can."""
        self.failed = asyncio.Event()
        """Set with ``failure``."""
        self._scorers = (
            list(scorers) if scorers is not None else [build_scorer(c, on_exhausted=self._fail) for c in config.scorers]
        )
        self._whole_payloads = any(s.reads_tokens for s in self._scorers)
        """A scorer reads token ids: payloads are read whole (else only their heads)."""
        self._weights = {c.name: c.weight for c in config.scorers}
        self._invalid_value = config.invalid_value if config.on_invalid == "score" else None
        if sorted(s.name for s in self._scorers) != sorted(self._weights):
            raise ValueError(
                f"scorers {[s.name for s in self._scorers]} do not match the config's {list(self._weights)}"
            )
        self.provenance = "+".join(f"{c.name}:{c.type}" for c in config.scorers)
        """Written into every ScoredTrajectory's ``scorer`` field, e.g. ``math:function+rm:model``."""
        self._batcher: MicroBatcher[Trajectory, CombinedScore] = MicroBatcher(
            self._score_batch,
            config.max_batch_size,
            config.max_wait_ms,
            split_on=_is_sample_specific,
        )
        self._pause: IntakePause[Trajectory] = IntakePause(
            self._probe, config.probe_interval_s, on_pause if on_pause is not None else lambda _: None
        )
        self._latency_ms_sum = 0.0
        self._num_scored = 0
        self._num_failed = 0
        self._num_retried = 0
        self._num_invalid = 0
        self._closed = False
        self._failed_attempts: dict[str, int] = {}
        """Trajectory id -> backend calls of its failed attempts so far (popped when it is scored)."""

    async def _fetch_batch(self, records: list[TrajectoryRecord]) -> list[Trajectory]:
        if self._payloads is None:
            raise MissingPayloadError("this reward service was given no payload source: it can score only Trajectories")
        return await self._payloads.fetch(records, self._whole_payloads)

    async def handle(self, msg: TrajectoryRecord | Trajectory) -> list[Output]:
        """Score one trajectory (its payload fetched, scored in a batch with concurrent calls): a ScoredRecord
        for a record, a ScoredTrajectory for a whole Trajectory; raises ScorerError (or MissingPayloadError)."""
        if isinstance(msg, Trajectory):
            return await self._score(msg, None)
        trajectory = await self._fetcher.submit(msg)
        return await self._score(trajectory, msg)

    async def _score(self, msg: Trajectory, record: TrajectoryRecord | None) -> list[Output]:
        started = time.perf_counter()
        attributes = {TRAJECTORY_ID: msg.id, SCORER: self.provenance}
        with self._tracing.span(REWARD, msg.traceparent, attributes=attributes) as span:
            try:
                combined = await self._submit(msg)
                if combined.invalid:
                    self._invalid(msg, combined.invalid)
            except Exception:  # counted and re-raised; the span is marked failed on the way out
                self._num_failed += 1
                span.set(RETRIES, max(0, self._failed_attempts.get(msg.id, 0) - 1))
                raise
            latency_ms = (time.perf_counter() - started) * 1e3
            attempts = self._failed_attempts.pop(msg.id, 0) + combined.attempts
            span.set_attributes({REWARD_VALUE: combined.reward, RETRIES: attempts - 1, REMOTE_LATENCY_MS: latency_ms})
        self._latency_ms_sum += latency_ms
        self._num_scored += 1
        self._num_retried += attempts > 1
        self._metrics.count_samples("scored", 1)
        turn_rewards = episode_rewards(msg, combined.reward)
        scored = ScoredRecord(
            trajectory=record if record is not None else record_of(msg, "", 0),
            reward=sum(turn_rewards) if turn_rewards else combined.reward,
            turn_rewards=turn_rewards,
            score=combined.score,
            extra={**combined.extra, "reward/attempts": float(attempts), "reward/retried": float(attempts > 1)},
            scorer=self.provenance,
            reward_latency_ms=latency_ms,
            traceparent=span.traceparent,
        )
        if record is None:  # a whole Trajectory in: a whole ScoredTrajectory out
            return [Output(stream=self._names.scored, message=assemble(scored, msg))]
        return [Output(stream=self._names.scored, message=scored)]

    async def _submit(self, msg: Trajectory) -> CombinedScore:
        """Score ``msg`` in a micro-batch; while intake is paused by a permanent error, wait for it to resume."""
        while True:
            await self._pause.wait()
            try:
                return await self._batcher.submit(msg)
            except PermanentScorerError as e:
                self._pause.trip(str(e), msg)

    async def _probe(self, sample: Trajectory) -> None:
        """Score ``sample`` alone with every scorer (the pause's probe); raises what a scorer raises."""
        tasks = [asyncio.ensure_future(s.score([sample])) for s in self._scorers]
        try:
            await asyncio.gather(*tasks)
        finally:
            await cancel_and_wait(tasks)

    async def _score_batch(self, batch: list[Trajectory]) -> list[CombinedScore]:
        tasks = [asyncio.ensure_future(self._call(s, batch)) for s in self._scorers]
        try:
            results: list[ScorerResult] = await asyncio.gather(*tasks)
        except BaseException as e:
            for task in tasks:  # one scorer failed: the batch fails, stop the others
                task.cancel()
            if isinstance(e, Exception):
                self._count_failed_attempts(batch, e.attempts if isinstance(e, ScorerError) else 1)
            raise
        return combine(
            [WeightedResult(s.name, self._weights[s.name], r) for s, r in zip(self._scorers, results, strict=True)],
            invalid_value=self._invalid_value,
        )

    def _invalid(self, msg: Trajectory, why: str) -> None:
        """A sample whose answer was unusable: fail it alone (``dead_letter``), or count and go on (``score``)."""
        self._num_invalid += 1
        if self._invalid_value is None:
            self._count_failed_attempts([msg], 1)  # its calls count if a later delivery scores it
            raise ScorerError(
                f"unusable answer for trajectory {msg.id}: {why} (reward.on_invalid = 'dead_letter'; "
                "'score' with reward.invalid_value scores such samples instead)"
            )
        if (self._num_invalid - 1) % INVALID_LOG_EVERY == 0:
            logger.warning(
                "reward: %d samples scored %g (reward.invalid_value) for an unusable answer so far; latest, %s: %s",
                self._num_invalid,
                self._invalid_value,
                msg.id,
                why,
            )

    async def _call(self, scorer: Scorer, batch: list[Trajectory]) -> ScorerResult:
        """One scorer's call on a micro-batch, observed in the metrics (a cancelled call is not)."""
        started = time.perf_counter()
        try:
            result = await scorer.score(batch)
        except ScorerError as e:
            latency_s = time.perf_counter() - started
            self._metrics.observe_reward(scorer.name, latency_s=latency_s, retries=e.attempts - 1, failed=True)
            raise
        self._metrics.observe_reward(scorer.name, latency_s=time.perf_counter() - started, retries=result.retries)
        return result

    def _count_failed_attempts(self, batch: list[Trajectory], attempts: int) -> None:
        for trajectory in batch:
            self._failed_attempts[trajectory.id] = self._failed_attempts.pop(trajectory.id, 0) + attempts
        while len(self._failed_attempts) > MAX_TRACKED_FAILURES:
            del self._failed_attempts[next(iter(self._failed_attempts))]

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            logger.error("scoring cannot go on: %s; stopping (restart the worker)", reason)
            self.failed.set()

    def metrics(self) -> dict[str, float]:
        """Counters: scorers' own (``reward/http/retries``, ...) summed by name, plus outcomes, batching
        and latency."""
        totals: dict[str, float] = {}
        for scorer in self._scorers:
            for name, value in scorer.metrics().items():
                totals[name] = totals.get(name, 0.0) + value
        batches = self._batcher.num_batches
        totals["reward/scored"] = float(self._num_scored)
        totals["reward/failed"] = float(self._num_failed)
        totals["reward/retried"] = float(self._num_retried)
        totals["reward/invalid"] = float(self._num_invalid)
        totals["reward/batches"] = float(batches)
        totals["reward/batch_size_mean"] = self._batcher.num_items / batches if batches else 0.0
        totals["reward/latency_ms_mean"] = self._latency_ms_sum / self._num_scored if self._num_scored else 0.0
        totals["reward/paused"] = float(self._pause.cause is not None)
        totals["reward/pauses"] = float(self._pause.num_pauses)
        return totals

    async def stopping(self) -> None:
        """The worker stops: deliveries waiting for a pause to end are cancelled at once (their entries stay pending
        for the next worker) instead of waiting out the drain; the others drain as usual."""
        await self._pause.close()

    async def close(self) -> None:
        """Cancel the calls still waiting for scores (their entries stay pending), then close the scorers."""
        if self._closed:
            return
        self._closed = True
        await self._pause.close()
        await self._fetcher.close()
        await self._batcher.close()
        for scorer in self._scorers:
            await scorer.close()
