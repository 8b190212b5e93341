"""The reward service's spans and metrics on in-process scorers: one span per trajectory under its
traceparent, the scored trajectory carrying the span's, scorer calls observed by scorer name."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
from msgspec.structs import replace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from streamrl.common.messages import ScoredTrajectory, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.prom import PromMetrics
from streamrl.common.telemetry.trace_schema import (
    REMOTE_LATENCY_MS,
    RETRIES,
    REWARD,
    REWARD_VALUE,
    SCORER,
    TRAJECTORY_ID,
)
from streamrl.common.telemetry.tracing import Tracing, format_traceparent, parse_traceparent, setup_tracing
from streamrl.common.telemetry.tracing_config import TracingConfig
from streamrl.reward.config import RewardConfig
from streamrl.reward.scorers.base import ScorerResult
from streamrl.reward.service import RewardService


class Scorer:
    """reward = response length; every call reports ``retries`` backend retries."""

    reads_tokens = False

    def __init__(self, name: str, retries: int) -> None:
        self.name = name
        self.retries = retries

    async def score(self, batch: list[Trajectory]) -> ScorerResult:
        await asyncio.sleep(0.005)
        n = [float(len(t.response_text)) for t in batch]
        return ScorerResult(rewards=n, scores=[0.0] * len(n), extra=[{} for _ in n], retries=self.retries)

    def metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None


@pytest.fixture
def traced() -> Iterator[tuple[Tracing, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracing = setup_tracing(
        TracingConfig(sampling="all"),
        service="reward",
        instance="reward-0",
        run_id="r",
        run_dir="unused",
        exporter=exporter,
    )
    yield tracing, exporter
    tracing.shutdown()


def score(service: RewardService, trajectories: list[Trajectory]) -> list[ScoredTrajectory]:
    async def main() -> list[ScoredTrajectory]:
        outputs = await asyncio.gather(*(service.handle(t) for t in trajectories))
        await service.close()
        return [out.message for (out,) in outputs]  # type: ignore[misc]

    return asyncio.run(main())


def finished(tracing: Tracing, exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    assert tracing.flush()
    return list(exporter.get_finished_spans())


def test_each_trajectory_gets_a_reward_span_and_each_scorer_call_is_observed(
    traj: Callable[..., Trajectory], traced: tuple[Tracing, InMemorySpanExporter]
) -> None:
    tracing, exporter = traced
    metrics = PromMetrics()
    config = RewardConfig(
        scorers=[{"type": "function", "name": n, "path": "unused.py", "weight": 1.0} for n in ("a", "b")],
        max_batch_size=4,
        max_wait_ms=20,
    )
    service = RewardService(
        config, StreamNames("r"), scorers=[Scorer("a", 0), Scorer("b", 2)], tracing=tracing, metrics=metrics
    )
    trajectories = [traj(i, response="x" * i) for i in range(1, 9)]  # (trace id 0 is no trace)
    results = score(service, trajectories)
    spans = {x.attributes[TRAJECTORY_ID]: x for x in finished(tracing, exporter)}
    assert sorted(spans) == sorted(t.id for t in trajectories)
    for t, scored in zip(trajectories, results, strict=True):
        span = spans[t.id]
        parent = parse_traceparent(t.traceparent)
        assert parent is not None and span.parent is not None
        assert (span.context.trace_id, span.parent.span_id) == parent[:2]
        assert span.name == REWARD and span.status.status_code.name == "UNSET"
        assert scored.traceparent == format_traceparent(span.context.trace_id, span.context.span_id, 1)
        assert span.attributes[SCORER] == "a:function+b:function"
        assert span.attributes[REWARD_VALUE] == scored.reward == 2 * len(t.response_text)
        assert span.attributes[RETRIES] == 0  # a retried scorer call still answered each sample at its first try
        assert span.attributes[REMOTE_LATENCY_MS] == scored.reward_latency_ms >= 5
    value = metrics.registry.get_sample_value
    for name, retries in (("a", 0), ("b", 2)):
        assert value("streamrl_reward_latency_seconds_count", {"scorer": name}) == 2  # two micro-batches of 4
        assert value("streamrl_reward_latency_seconds_sum", {"scorer": name}) >= 2 * 0.005
        assert value("streamrl_reward_retries_total", {"scorer": name}) == (2 * retries or None)
        assert value("streamrl_reward_failures_total", {"scorer": name}) is None


def test_an_unsampled_trajectory_has_no_span_and_keeps_its_traceparent(
    traj: Callable[..., Trajectory], traced: tuple[Tracing, InMemorySpanExporter]
) -> None:
    tracing, exporter = traced
    config = RewardConfig(scorers=[{"type": "function", "name": "a", "path": "unused.py"}], max_wait_ms=1)
    service = RewardService(config, StreamNames("r"), scorers=[Scorer("a", 0)], tracing=tracing)
    trajectory = replace(traj(1), traceparent=traj(1).traceparent[:-2] + "00")  # its trace was left out
    (scored,) = score(service, [trajectory])
    assert finished(tracing, exporter) == []
    assert scored.traceparent == trajectory.traceparent
