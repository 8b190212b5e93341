"""The reward service's handler: Trajectory in, one ScoredTrajectory out to the scored stream.

    consumer loop (streamrl.common.consumer) --handle(traj)--> MicroBatcher --batch--> scorers
                                                                                 |  (concurrently)
    Output(names.scored, ScoredTrajectory) <-- combine (weights) <---------------+

Concurrent ``handle`` calls (the loop runs up to ``max_in_flight`` at once) are grouped into
micro-batches, so every scorer sees batches, not single samples. A scorer that fails raises
``ScorerError`` with the reason: the loop retries the entry and finally dead-letters it with that
reason; nothing is ever scored 0 by default. When a batch fails for a reason that may be
sample-specific (a user function raised), its trajectories are re-scored one by one so only the
bad one fails. De-duplication by trajectory id is the loop's job.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence

from streamrl.common.bus import Output
from streamrl.common.messages import ScoredTrajectory, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.reward.batcher import MicroBatcher
from streamrl.reward.combine import CombinedScore, WeightedResult, combine
from streamrl.reward.config import RewardConfig
from streamrl.reward.scorers import Scorer, ScorerError, ScorerResult, build_scorer


def _is_sample_specific(error: BaseException) -> bool:
    return isinstance(error, ScorerError) and error.sample_specific


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
    ) -> None:
        self._names = names
        self._scorers = list(scorers) if scorers is not None else [build_scorer(c) for c in config.scorers]
        self._weights = {c.name: c.weight for c in config.scorers}
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
        self._latency_ms_sum = 0.0
        self._num_scored = 0

    async def handle(self, msg: Trajectory) -> list[Output]:
        """Score one trajectory (batched with concurrent calls); raises ScorerError on failure."""
        started = time.perf_counter()
        combined = await self._batcher.submit(msg)
        latency_ms = (time.perf_counter() - started) * 1e3
        self._latency_ms_sum += latency_ms
        self._num_scored += 1
        scored = ScoredTrajectory(
            trajectory=msg,
            reward=combined.reward,
            score=combined.score,
            extra=combined.extra,
            scorer=self.provenance,
            reward_latency_ms=latency_ms,
            traceparent=msg.traceparent,
        )
        return [Output(stream=self._names.scored, message=scored)]

    async def _score_batch(self, batch: list[Trajectory]) -> list[CombinedScore]:
        tasks = [asyncio.ensure_future(s.score(batch)) for s in self._scorers]
        try:
            results: list[ScorerResult] = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one scorer failed: the batch fails, stop the others
                task.cancel()
            raise
        return combine(
            [WeightedResult(s.name, self._weights[s.name], r) for s, r in zip(self._scorers, results, strict=True)]
        )

    def metrics(self) -> dict[str, float]:
        """Counters: scorers' own (``reward/http/retries``, ...) summed by name, plus batching and latency."""
        totals: Counter[str] = Counter()
        for scorer in self._scorers:
            totals.update(scorer.metrics())
        batches = self._batcher.num_batches
        totals["reward/scored"] = float(self._num_scored)
        totals["reward/batches"] = float(batches)
        totals["reward/batch_size_mean"] = self._batcher.num_items / batches if batches else 0.0
        totals["reward/latency_ms_mean"] = self._latency_ms_sum / self._num_scored if self._num_scored else 0.0
        return dict(totals)

    async def close(self) -> None:
        await self._batcher.close()
        for scorer in self._scorers:
            await scorer.close()
