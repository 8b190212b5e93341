"""The reward tier's spans through the real consumer loop, a real redis-server and the remote test
reward service (reward_server.py): a redelivered entry gets a second span under the same parent and
only that one has the scored trajectory under it; a remote that keeps failing leaves failed spans
with their retries counted, and the Prometheus counters say the same."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from reward_server import ServerProcess

from streamrl.common.bus import Bus, connect
from streamrl.common.codec import decode
from streamrl.common.config import ConsumerConfig
from streamrl.common.consumer import ConsumerLoop, encode_payload
from streamrl.common.messages import DeadLetter, ScoredTrajectory, Tensor, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.prom import PromMetrics
from streamrl.common.telemetry.trace_schema import (
    ATTEMPT,
    KEEP,
    REMOTE_LATENCY_MS,
    RETRIES,
    REWARD,
    REWARD_VALUE,
    SCORER,
)
from streamrl.common.telemetry.tracing import SAMPLED, format_traceparent, setup_tracing
from streamrl.common.telemetry.tracing_config import TracingConfig
from streamrl.reward.config import RewardConfig
from streamrl.reward.service import RewardService

TRACE_ID, PARENT_SPAN = 0x5EED, 0xF00D
"""The rollout's generate span the trajectory's traceparent names."""
TRAJECTORY = Trajectory(
    id="g0/0",
    group_id="g0",
    group_index=0,
    group_size=1,
    prompt_ids=Tensor.from_list([1], "int32"),
    response_ids=Tensor.from_list([2], "int32"),
    logprobs=Tensor.from_list([-1.0], "float32"),
    loss_mask=Tensor.from_list([1], "uint8"),
    prompt_text="p: ",
    response_text="rrr",
    traceparent=format_traceparent(TRACE_ID, PARENT_SPAN, SAMPLED),
)


class Run:
    """One reward consumer in this process: its spans in memory, its metrics in a registry of its own."""

    def __init__(self, redis_url: str, run_id: str, url: str, max_deliveries: int) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracing = setup_tracing(
            TracingConfig(sampling="all"),
            service="reward",
            instance="r0",
            run_id=run_id,
            run_dir="unused",
            exporter=self.exporter,
        )
        self.metrics = PromMetrics()
        self.names = StreamNames(run_id)
        self.redis_url = redis_url
        self.reward = RewardConfig(
            scorers=[
                {
                    "type": "http",
                    "name": "remote",
                    "urls": [url],
                    "max_retries": 1,
                    "backoff_base_s": 0.01,
                    "backoff_max_s": 0.02,
                    "timeout_s": 5,
                }
            ],
            max_batch_size=4,
            max_wait_ms=5,
        )
        self.consumer = ConsumerConfig(
            block_ms=50, claim_interval_s=0.2, retry_delay_s=0.05, max_deliveries=max_deliveries
        )

    def consume(self) -> tuple[list[ScoredTrajectory], list[DeadLetter]]:
        """Publish the trajectory, consume until drained (burst); the scored and dead-lettered entries."""

        async def main() -> tuple[list[ScoredTrajectory], list[DeadLetter]]:
            redis = connect(self.redis_url)
            bus = Bus(redis)
            service = RewardService(self.reward, self.names, tracing=self.tracing, metrics=self.metrics)
            loop: ConsumerLoop[Trajectory] = ConsumerLoop(
                bus,
                self.names,
                stream=self.names.trajectories,
                group="reward",
                consumer="r0",
                handler=service.handle,
                message_type=Trajectory,
                config=self.consumer,
            )
            try:
                await redis.xadd(self.names.trajectories, encode_payload(TRAJECTORY))
                await asyncio.wait_for(loop.run(asyncio.Event(), burst=True), timeout=60)
                scored = [decode(f[b"d"], ScoredTrajectory) for _, f in await redis.xrange(self.names.scored)]
                dead = [decode(f[b"d"], DeadLetter) for _, f in await redis.xrange(self.names.dead)]
            finally:
                await service.close()
                await redis.aclose()
            return scored, dead

        return asyncio.run(main())

    def spans(self) -> list[ReadableSpan]:
        assert self.tracing.flush()
        spans = sorted(self.exporter.get_finished_spans(), key=lambda x: x.attributes[ATTEMPT])
        assert {x.name for x in spans} == {REWARD}
        for span in spans:  # every attempt a child of the rollout's span, in its trace
            assert span.context.trace_id == TRACE_ID
            assert span.parent is not None and span.parent.span_id == PARENT_SPAN
        return spans

    def metric(self, name: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, {"scorer": "remote"})


@pytest.fixture
def run(redis_url: str, run_id: str, request: pytest.FixtureRequest) -> Iterator[Run]:
    faults, max_deliveries = request.param
    server = ServerProcess(*faults)
    server.start()
    made = Run(redis_url, run_id, server.url, max_deliveries)
    yield made
    made.tracing.shutdown()
    server.kill()


@pytest.mark.parametrize("run", [(("--faults", "500,500"), 3)], indirect=True)
def test_a_redelivered_entry_gets_a_second_span_under_the_same_parent(run: Run) -> None:
    """Delivery 1: two HTTP 500s (max_retries = 1) fail it; delivery 2 scores it at its first call."""
    (scored,), dead = run.consume()
    assert dead == []
    first, second = run.spans()
    assert [first.attributes[ATTEMPT], second.attributes[ATTEMPT]] == [1, 2]
    assert first.status.status_code.name == "ERROR" and "not scored after 2 attempts" in str(first.status.description)
    assert first.attributes[RETRIES] == 1 and first.attributes[KEEP] == "failed"
    assert REWARD_VALUE not in first.attributes
    assert second.status.status_code.name == "UNSET" and KEEP not in second.attributes
    assert second.attributes[RETRIES] == 2 == scored.extra["reward/attempts"] - 1  # three calls in all
    assert second.attributes[REWARD_VALUE] == scored.reward == len("p: rrr")
    assert second.attributes[REMOTE_LATENCY_MS] == scored.reward_latency_ms
    assert second.attributes[SCORER] == scored.scorer == "remote:http"
    # one scored trajectory, under the attempt that committed: the failed one has no children
    assert scored.traceparent == format_traceparent(TRACE_ID, second.context.span_id, SAMPLED)
    # the scorer's calls: one failed after one retry, one answered at once
    assert run.metric("streamrl_reward_latency_seconds_count") == 2
    assert (run.metric("streamrl_reward_retries_total"), run.metric("streamrl_reward_failures_total")) == (1, 1)


@pytest.mark.parametrize("run", [(("--always", "500"), 2)], indirect=True)
def test_a_remote_that_keeps_failing_leaves_failed_spans_with_their_retries(run: Run) -> None:
    scored, (letter,) = run.consume()
    assert scored == [] and letter.deliveries == 2
    spans = run.spans()
    assert [x.attributes[ATTEMPT] for x in spans] == [1, 2]
    assert [x.status.status_code.name for x in spans] == ["ERROR", "ERROR"]
    assert [x.status.description for x in spans] == [letter.error] * 2
    assert [x.attributes[RETRIES] for x in spans] == [1, 3]  # two calls per delivery, counted across deliveries
    assert all(x.attributes[KEEP] == "failed" for x in spans)
    assert run.metric("streamrl_reward_latency_seconds_count") == 2
    assert (run.metric("streamrl_reward_retries_total"), run.metric("streamrl_reward_failures_total")) == (2, 2)
