"""RewardService.handle on in-process scorers: batching, combination, provenance, failures."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from streamrl.common.bus import Output
from streamrl.common.messages import ScoredRecord, ScoredTrajectory, Trajectory, TrajectoryRecord
from streamrl.common.payloads import record_of
from streamrl.common.streams import StreamNames
from streamrl.reward.config import ModelScorerConfig, RewardConfig
from streamrl.reward.scorers import FunctionScorer, HttpScorer, ModelScorer
from streamrl.reward.scorers.base import ScorerError, ScorerResult
from streamrl.reward.service import RewardService


class LengthScorer:
    """reward = response length; records batch sizes."""

    reads_tokens = False

    def __init__(self, name: str, fail_on: str | None = None, sample_specific: bool = True) -> None:
        self.name = name
        self.batch_sizes: list[int] = []
        self.fail_on = fail_on
        self.sample_specific = sample_specific

    async def score(self, batch: list[Trajectory]) -> ScorerResult:
        self.batch_sizes.append(len(batch))
        if any(t.response_text == self.fail_on for t in batch):
            raise ScorerError(
                f"{self.name}: cannot score {self.fail_on!r}",
                sample_specific=self.sample_specific,
            )
        n = [float(len(t.response_text)) for t in batch]
        return ScorerResult(
            rewards=n,
            scores=[min(1.0, x / 10) for x in n],
            extra=[{"len": x} for x in n],
        )

    def metrics(self) -> dict[str, float]:
        return {"reward/test/calls": float(len(self.batch_sizes))}

    async def close(self) -> None:
        return None


def _config(weights: dict[str, float], max_batch_size: int = 16) -> RewardConfig:
    return RewardConfig(
        scorers=[{"type": "function", "name": n, "path": "unused.py", "weight": w} for n, w in weights.items()],
        max_batch_size=max_batch_size,
        max_wait_ms=20,
    )


def test_handle_scores_batches_and_publishes_to_scored(
    traj: Callable[..., Trajectory],
) -> None:
    names = StreamNames("run1")
    a, b = LengthScorer("a"), LengthScorer("b")
    service = RewardService(_config({"a": 1.0, "b": 0.5}, max_batch_size=4), names, scorers=[a, b])

    async def main() -> list[list[object]]:
        outs = await asyncio.gather(*(service.handle(traj(i, response="x" * (i + 1))) for i in range(8)))
        await service.close()
        return outs  # type: ignore[return-value]

    outputs = asyncio.run(main())
    assert a.batch_sizes == [4, 4] and b.batch_sizes == [4, 4]
    for i, (out,) in enumerate(outputs):
        n = i + 1
        assert out.stream == names.scored
        scored = out.message
        assert isinstance(scored, ScoredTrajectory)
        assert scored.trajectory.id == traj(i).id
        assert scored.reward == pytest.approx(1.5 * n)
        assert scored.score == pytest.approx(min(1.0, n / 10))
        assert scored.extra == {
            "a/reward": n,
            "a/score": min(1.0, n / 10),
            "a/len": n,
            "b/reward": n,
            "b/score": min(1.0, n / 10),
            "b/len": n,
            "reward/attempts": 1.0,
            "reward/retried": 0.0,
        }
        assert scored.scorer == "a:function+b:function"
        assert scored.traceparent == traj(i).traceparent
        assert scored.reward_latency_ms > 0
    metrics = service.metrics()
    assert metrics["reward/scored"] == 8 and metrics["reward/batch_size_mean"] == 4
    assert metrics["reward/test/calls"] == 4  # summed over both scorers


def test_a_bad_sample_fails_alone(traj: Callable[..., Trajectory]) -> None:
    scorer = LengthScorer("a", fail_on="boom")
    service = RewardService(_config({"a": 1.0}), StreamNames("r"), scorers=[scorer])

    async def main() -> list[object]:
        batch = [
            traj(0, response="ok"),
            traj(1, response="boom"),
            traj(2, response="fine"),
        ]
        return await asyncio.gather(*(service.handle(t) for t in batch), return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[1], ScorerError) and "cannot score 'boom'" in str(results[1])
    good = [r[0].message for r in (results[0], results[2])]  # type: ignore[index]
    assert [s.reward for s in good] == [2.0, 4.0]
    assert scorer.batch_sizes == [3, 1, 1, 1]
    # Their batch failed once before they were scored alone: two attempts each.
    assert [(s.extra["reward/attempts"], s.extra["reward/retried"]) for s in good] == [(2.0, 1.0)] * 2
    assert service.metrics()["reward/failed"] == 1 and service.metrics()["reward/retried"] == 2


def test_backend_failure_fails_the_batch_without_splitting(
    traj: Callable[..., Trajectory],
) -> None:
    scorer = LengthScorer("a", fail_on="boom", sample_specific=False)
    service = RewardService(_config({"a": 1.0}), StreamNames("r"), scorers=[scorer])

    async def main() -> list[object]:
        batch = [traj(0, response="ok"), traj(1, response="boom")]
        return await asyncio.gather(*(service.handle(t) for t in batch), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, ScorerError) for r in results)
    assert scorer.batch_sizes == [2]


class FlakyBackend:
    """Fails its first ``failures`` calls as a backend that gave up after 3 calls, then answers
    after 2 calls (as an HTTP scorer reports its retries)."""

    reads_tokens = False

    def __init__(self, failures: int) -> None:
        self.name = "a"
        self.failures = failures

    async def score(self, batch: list[Trajectory]) -> ScorerResult:
        if self.failures:
            self.failures -= 1
            raise ScorerError("a: backend down", attempts=3)
        ones = [1.0] * len(batch)
        return ScorerResult(rewards=ones, scores=ones, extra=[{} for _ in batch], attempts=[2] * len(batch))

    def metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None


def test_attempts_of_earlier_deliveries_reach_the_scored_trajectory(traj: Callable[..., Trajectory]) -> None:
    """The retry counters reach the metrics through each ScoredTrajectory's extra (the coordinator
    averages every extra key per batch); before, nothing said a trajectory had been retried."""
    service = RewardService(_config({"a": 1.0}), StreamNames("r"), scorers=[FlakyBackend(failures=1)])

    async def main() -> ScoredTrajectory:
        with pytest.raises(ScorerError, match="backend down"):
            await service.handle(traj(0))  # the consumer loop delivers the entry again
        (out,) = await service.handle(traj(0))
        await service.close()
        return out.message  # type: ignore[return-value]

    scored = asyncio.run(main())
    assert scored.extra["reward/attempts"] == 5.0 and scored.extra["reward/retried"] == 1.0
    metrics = service.metrics()
    assert (metrics["reward/failed"], metrics["reward/retried"], metrics["reward/scored"]) == (1, 1, 1)


class NeverAnswers:
    """A backend that never answers (a server hanging while the service stops)."""

    reads_tokens = False
    name = "a"

    async def score(self, batch: list[Trajectory]) -> ScorerResult:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None


def test_close_leaves_waiting_and_late_calls_cancelled_not_failed(traj: Callable[..., Trajectory]) -> None:
    """On stop the entries being scored must stay pending (their handler task is cancelled), never
    fail with "MicroBatcher is closed" (which the consumer loop counted and dead-lettered)."""
    service = RewardService(_config({"a": 1.0}), StreamNames("r"), scorers=[NeverAnswers()])

    async def main() -> list[asyncio.Task[object]]:
        waiting = [asyncio.create_task(service.handle(traj(i))) for i in range(3)]
        await asyncio.sleep(0.05)
        await service.close()
        late = asyncio.create_task(service.handle(traj(9)))  # a retry that wakes up after close
        await asyncio.wait([*waiting, late])
        return [*waiting, late]

    tasks = asyncio.run(main())
    assert all(t.cancelled() for t in tasks)
    assert service.metrics()["reward/failed"] == 0


def test_built_from_config_with_a_reward_file(tmp_path: Path, traj: Callable[..., Trajectory]) -> None:
    path = tmp_path / "r.py"
    path.write_text(
        "def reward_func(queries, prompts, labels):\n    return {'rewards': [float(l == 'yes') for l in labels]}\n"
    )
    config = RewardConfig(scorers=[{"type": "function", "name": "yes", "path": str(path)}], max_wait_ms=1)
    service = RewardService(config, StreamNames("r"))
    (out,) = asyncio.run(service.handle(traj(0, label="yes")))
    assert out.message.reward == 1.0 and out.message.scorer == "yes:function"  # type: ignore[attr-defined]


def test_scorers_must_match_config() -> None:
    with pytest.raises(ValueError, match="do not match"):
        RewardService(_config({"a": 1.0}), StreamNames("r"), scorers=[LengthScorer("b")])


class RecordingPayloads:
    """A payload source that hands back the given trajectories and records how each fetch was asked to read."""

    def __init__(self, trajectories: dict[str, Trajectory]) -> None:
        self.trajectories = trajectories
        self.whole: list[bool] = []

    async def fetch(self, records: list[TrajectoryRecord], whole: bool) -> list[Trajectory]:
        self.whole.append(whole)
        return [self.trajectories[r.id] for r in records]


@pytest.mark.parametrize("whole", [False, True])
def test_payloads_are_read_whole_only_for_a_scorer_on_token_ids(traj: Callable[..., Trajectory], whole: bool) -> None:
    sample = traj(0)
    payloads = RecordingPayloads({sample.id: sample})
    scorer = LengthScorer("s")
    scorer.reads_tokens = whole  # what the scorer says, whatever its config section's type
    service = RewardService(_config({"s": 1.0}), StreamNames("run1"), scorers=[scorer], payloads=payloads)

    async def main() -> list[Output]:
        try:
            return await service.handle(record_of(sample, "k", 100, 10))
        finally:
            await service.close()

    (out,) = asyncio.run(main())
    assert payloads.whole == [whole]
    assert isinstance(out.message, ScoredRecord) and out.message.reward == len(sample.response_text)


@pytest.mark.parametrize(
    ("scorer", "reads"),
    [
        ({"type": "http", "urls": ["http://127.0.0.1:1/score"]}, False),
        ({"type": "model", "path": "unused", "input": "text"}, False),
        ({"type": "model", "path": "unused", "input": "token_ids"}, True),
    ],
)
def test_only_a_model_on_token_ids_reads_tokens(scorer: dict[str, object], reads: bool) -> None:
    (config,) = RewardConfig(scorers=[{**scorer, "name": "s"}]).scorers
    built = ModelScorer(config, model=object()) if isinstance(config, ModelScorerConfig) else HttpScorer(config)  # type: ignore[arg-type]
    assert built.reads_tokens is reads
    assert FunctionScorer.reads_tokens is False
