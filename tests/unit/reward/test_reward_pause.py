"""A permanent scorer error pauses the reward worker's intake instead of failing (and at last dead-lettering)
every trajectory: the deliveries wait, the cause is told once, a probe resumes scoring by itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from streamrl.common.aio import timeout
from streamrl.common.messages import Trajectory
from streamrl.common.streams import StreamNames
from streamrl.reward.config import RewardConfig
from streamrl.reward.scorers.base import PermanentScorerError, ScorerResult
from streamrl.reward.service import RewardService


class RefusingScorer:
    """Refuses every call (a wrong token) until ``accept`` is set."""

    name = "remote"
    reads_tokens = False

    def __init__(self) -> None:
        self.accept = False
        self.calls = 0

    async def score(self, batch: list[Trajectory]) -> ScorerResult:
        self.calls += 1
        if not self.accept:
            raise PermanentScorerError("http scorer 'remote': HTTP 401, not retried: the server refused the token")
        return ScorerResult(rewards=[1.0] * len(batch), scores=[1.0] * len(batch), extra=[{} for _ in batch])

    def metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None


def test_a_refused_token_pauses_scoring_until_a_probe_is_accepted(traj: Callable[..., Trajectory]) -> None:
    config = RewardConfig(
        scorers=[{"type": "function", "name": "remote", "path": "unused.py"}],
        max_batch_size=4,
        max_wait_ms=5,
        probe_interval_s=0.05,
    )
    scorer = RefusingScorer()
    told: list[str] = []
    service = RewardService(config, StreamNames("run1"), scorers=[scorer], on_pause=told.append)

    async def main() -> None:
        handles = [asyncio.ensure_future(service.handle(traj(i))) for i in range(8)]
        await asyncio.sleep(0.5)  # ten probe intervals
        assert not any(h.done() for h in handles), "a delivery failed (it would be retried, then dead-lettered)"
        assert told == ["http scorer 'remote': HTTP 401, not retried: the server refused the token"]  # once
        assert service.metrics()["reward/paused"] == 1.0
        calls_paused = scorer.calls
        assert calls_paused <= 2 + 12, calls_paused  # the two batches, then one probe per interval: no hammering
        scorer.accept = True  # the token rotated back
        async with timeout(5.0):
            outputs = await asyncio.gather(*handles)
        assert [o.message.reward for (o,) in outputs] == [1.0] * 8
        assert told[-1] == "" and len(told) == 2
        assert service.metrics()["reward/paused"] == 0.0 and service.metrics()["reward/pauses"] == 1.0
        await service.close()

    asyncio.run(main())


def test_a_worker_stopping_while_paused_cancels_the_waiting_deliveries_at_once(traj: Callable[..., Trajectory]) -> None:
    """Nothing to drain while paused: the deliveries are cancelled (their entries stay pending for the next worker)
    instead of holding the stop for the whole shutdown grace."""
    config = RewardConfig(
        scorers=[{"type": "function", "name": "remote", "path": "unused.py"}], max_wait_ms=5, probe_interval_s=60
    )
    service = RewardService(config, StreamNames("run1"), scorers=[RefusingScorer()])

    async def main() -> None:
        handles = [asyncio.ensure_future(service.handle(traj(i))) for i in range(3)]
        await asyncio.sleep(0.2)
        assert service.metrics()["reward/paused"] == 1.0
        await service.stopping()
        async with timeout(2.0):
            done = await asyncio.gather(*handles, return_exceptions=True)
        assert all(isinstance(d, asyncio.CancelledError) for d in done), done
        await service.close()

    asyncio.run(main())
