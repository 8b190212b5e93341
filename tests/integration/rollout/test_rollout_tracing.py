"""The rollout worker's spans and metrics: queue and generation spans of one prompt, a weight load per version.

The service runs against a real redis-server with an engine stand-in that returns fixed samples
(the spans depend only on what an engine returns); spans go to the SDK's in-memory exporter and
metrics to a Prometheus registry of the test's own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from streamrl.common.bus import Bus, connect
from streamrl.common.errors import WeightSyncError
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import (
    IpcWeights,
    PromptWorkItem,
    SamplingParams,
    Tensor,
    Trajectory,
    TrajectoryRecord,
    WeightsBroadcast,
    WeightsPublished,
)
from streamrl.common.payload_format import unpack_payload
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.prom import PromMetrics
from streamrl.common.telemetry.trace_schema import (
    ATTEMPT,
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
from streamrl.common.telemetry.tracing import (
    NULL_TRACING,
    SAMPLED,
    Tracing,
    format_traceparent,
    parse_traceparent,
    set_delivery_attempt,
    setup_tracing,
    weights_traceparent,
)
from streamrl.common.telemetry.tracing_config import TracingConfig
from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import GenerationRequest, Sample
from streamrl.rollout.service import RolloutService

ISSUE_TRACE, ISSUE_SPAN = 0xABC, 0x123
"""The coordinator's issue span the prompt's traceparent names."""


class FakeEngine:
    """Answers each prompt with ``samples``; takes weights as told (``fail`` / ``ahead``)."""

    def __init__(self, samples: list[Sample], metrics: PromMetrics) -> None:
        self.version = 0
        self.samples = samples
        self.metrics = metrics
        self.depth_seen: list[float | None] = []
        self.error: Exception | None = None
        self.fail_version: int | None = None
        self.ahead = 0

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        self.depth_seen.append(self.metrics.registry.get_sample_value("streamrl_engine_queue_depth"))
        await asyncio.sleep(0.01)
        if self.error is not None:
            raise self.error
        return [list(self.samples) for _ in requests]

    async def update_weights(self, event: WeightsPublished, timeout_s: float) -> None:
        version = event.version
        if version == self.fail_version:
            raise WeightSyncError(f"version {version} missed its deadline")
        self.version = version + (self.ahead if event.broadcast is not None else 0)

    def close(self) -> None:
        pass


def sample(tokens: int, start: int, end: int, reason: str, versions: list[tuple[int, int]] | None = None) -> Sample:
    return Sample(
        token_ids=list(range(tokens)),
        logprobs=[-0.5] * tokens,
        text="x" * tokens,
        finish_reason=reason,
        version_start=start,
        version_end=end,
        versions=versions or [],
    )  # type: ignore[arg-type]


SAMPLES = [sample(4, 2, 2, "stop"), sample(6, 2, 2, "length"), sample(5, 2, 3, "stop", [(0, 2), (3, 3)])]


class Harness:
    """A rollout service with in-memory spans, its own metrics registry and a fake engine."""

    def __init__(self, redis_url: str, run_id: str) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracing: Tracing = setup_tracing(
            TracingConfig(sampling="all"),
            service="rollout",
            instance="rollout-0",
            run_id=run_id,
            run_dir="unused",
            exporter=self.exporter,
        )
        self.metrics = PromMetrics()
        self.engine = FakeEngine(SAMPLES, self.metrics)
        self.config = RolloutConfig(run_id=run_id, engine=EngineConfig(model="unused", type="hf"))
        self.bus, self.names = Bus(connect(redis_url)), StreamNames(run_id)
        self.ctx = ServiceContext(
            "rollout",
            "rollout-0",
            self.config,
            self.bus,
            self.names,
            asyncio.Event(),
            tracing=self.tracing,
            metrics=self.metrics,
        )
        self.service = RolloutService(self.config, self.ctx, self.engine)  # type: ignore[arg-type]

    def spans(self, name: str) -> list[ReadableSpan]:
        assert self.tracing.flush()
        return [x for x in self.exporter.get_finished_spans() if x.name == name]

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels or {})


@pytest.fixture
def harness(redis_url: str, run_id: str) -> Iterator[Harness]:
    made = Harness(redis_url, run_id)
    yield made
    made.tracing.shutdown()


def prompt(flags: int = SAMPLED, issued_ago_s: float = 0.5) -> PromptWorkItem:
    return PromptWorkItem(
        id="p7",
        prompt_ids=Tensor.from_list([1, 2, 3], "int32"),
        sampling=SamplingParams(n=3),
        issued_at=time.time() - issued_ago_s,
        traceparent=format_traceparent(ISSUE_TRACE, ISSUE_SPAN, flags),
    )


def handle(harness: Harness, item: PromptWorkItem) -> list[Trajectory]:
    async def main() -> list[Trajectory]:
        set_delivery_attempt(1)  # as the consumer loop does
        try:
            outputs = await harness.service.handle(item)
            # the rollout stores each payload once and commits records: read the trajectories back
            records = [out.message for out in outputs if isinstance(out.message, TrajectoryRecord)]
            payloads = [await harness.bus.redis.get(record.payload_key) for record in records]
        finally:
            await harness.bus.redis.aclose()
        return [unpack_payload(payload) for payload in payloads]

    return asyncio.run(main())


def traceparent_of(span: ReadableSpan) -> str:
    return format_traceparent(span.context.trace_id, span.context.span_id, span.context.trace_flags)


def test_a_prompt_gets_a_queue_span_and_a_generate_span_per_sample(harness: Harness) -> None:
    item = prompt()
    trajectories = handle(harness, item)
    (queue,) = harness.spans(QUEUE)
    assert queue.context.trace_id == ISSUE_TRACE
    assert queue.parent is not None and queue.parent.span_id == ISSUE_SPAN and queue.parent.is_remote
    assert queue.start_time == int(item.issued_at * 1e9)  # from the issue ...
    assert queue.attributes == {GROUP_ID: "p7", ATTEMPT: 1}
    generates = sorted(harness.spans(GENERATE), key=lambda x: str(x.attributes[TRAJECTORY_ID]))
    assert len(generates) == 3
    for gen, traj, expected in zip(generates, trajectories, SAMPLES, strict=True):
        assert gen.parent is not None and gen.parent.span_id == queue.context.span_id
        assert gen.context.trace_id == ISSUE_TRACE
        assert gen.start_time == queue.end_time  # ... to the start of generation
        assert gen.end_time is not None and gen.end_time - gen.start_time >= 10_000_000  # the engine's 10 ms
        assert traj.traceparent == traceparent_of(gen)  # the reward tier's span hangs under this one
        assert dict(gen.attributes) == {
            TRAJECTORY_ID: traj.id,
            ENGINE: "hf",
            VERSION_START: expected.version_start,
            VERSION_END: expected.version_end,
            PARTIAL: expected.version_start != expected.version_end,
            NUM_PROMPT_TOKENS: 3,
            NUM_RESPONSE_TOKENS: len(expected.token_ids),
            FINISH_REASON: expected.finish_reason,
            ATTEMPT: 1,
            **({VERSIONS: "0:2,3:3"} if expected.versions else {}),
        }
        assert traj.policy_versions == expected.versions  # the per-token versions travel on
    assert [g.attributes[PARTIAL] for g in generates] == [False, False, True]
    assert [t.id for t in trajectories] == ["p7/0", "p7/1", "p7/2"]
    assert trajectories[0].timings["queue_s"] == pytest.approx((queue.end_time - queue.start_time) / 1e9, abs=1e-6)
    assert harness.metric("streamrl_samples_total", {"stage": "generated"}) == 3
    assert harness.metric("streamrl_tokens_total", {"stage": "generated"}) == 4 + 6 + 5
    assert harness.engine.depth_seen == [1.0] and harness.metric("streamrl_engine_queue_depth") == 0


@pytest.mark.parametrize("case", ["unsampled", "tracing off"])
def test_an_untraced_prompt_records_nothing_and_passes_its_traceparent_on(harness: Harness, case: str) -> None:
    if case == "tracing off":
        harness.ctx.tracing = NULL_TRACING
    item = prompt(flags=0 if case == "unsampled" else SAMPLED)
    trajectories = handle(harness, item)
    assert harness.spans(QUEUE) == [] and harness.spans(GENERATE) == []
    assert {t.traceparent for t in trajectories} == {item.traceparent}
    assert harness.metric("streamrl_samples_total", {"stage": "generated"}) == 3  # metrics count every sample


def test_an_engine_error_fails_every_sample_span(harness: Harness) -> None:
    harness.engine.error = RuntimeError("engine died")
    with pytest.raises(RuntimeError, match="engine died"):
        handle(harness, prompt())
    generates = harness.spans(GENERATE)
    assert len(generates) == 3
    assert {(x.status.status_code.name, x.status.description) for x in generates} == {
        ("ERROR", "RuntimeError: engine died")
    }
    assert harness.metric("streamrl_engine_queue_depth") == 0
    assert harness.metric("streamrl_samples_total", {"stage": "generated"}) is None


def weights(version: int, **kwargs: object) -> WeightsPublished:
    return WeightsPublished(
        version=version,
        step=version,
        batch_id="",
        checksum="c",
        num_bytes=1000 + version,
        num_buckets=1,
        endpoint="tcp://learner:1",
        **kwargs,
    )  # type: ignore[arg-type]


IPC = IpcWeights(device_uuid="GPU-0", block_bytes=4096, buffers=[], tensors=[])
BROADCAST = WeightsBroadcast(
    store="learner:29600", session="s1", backend="gloo", generation=1, block_bytes=4096, bucket_bytes=[4096], tensors=[]
)


def test_each_version_a_worker_loads_is_a_weights_load_span(harness: Harness, run_id: str) -> None:
    engine = harness.engine

    async def main() -> None:
        service = harness.service
        try:
            await service._apply(weights(1))
            await service._apply(weights(1))  # no version change: nothing loaded, no span
            await service._apply(weights(2, transport="ipc", ipc=IPC))
            await service._apply(weights(3))
            engine.ahead = 1
            await service._apply(weights(4, transport="broadcast", broadcast=BROADCAST))  # the member had version 5
            engine.fail_version = 6
            with pytest.raises(WeightSyncError):
                await service._apply(weights(6))
        finally:
            await harness.bus.redis.aclose()

    asyncio.run(main())
    loads = sorted(harness.spans(WEIGHTS_LOAD), key=lambda x: x.start_time or 0)
    rows = [(x.attributes[POLICY_VERSION], x.attributes.get(WEIGHTS_PATH), x.attributes[NUM_BYTES]) for x in loads]
    assert rows == [(1, "zmq", 1001), (2, "ipc", 1002), (3, "zmq", 1003), (5, "broadcast", 1004), (6, None, 1006)]
    for load, asked in zip(loads, [1, 2, 3, 4, 6], strict=True):
        # under the version's weights context, shared with the learner's publish span of that version
        parent = parse_traceparent(weights_traceparent(run_id, asked))
        assert parent is not None and load.parent is not None
        assert (load.context.trace_id, load.parent.span_id) == parent[:2]
    assert [x.status.status_code.name for x in loads] == ["UNSET"] * 4 + ["ERROR"]
    assert loads[-1].status.description == "WeightSyncError: version 6 missed its deadline"
    counts = {p: harness.metric("streamrl_weight_sync_seconds_count", {"path": p}) for p in ("zmq", "ipc", "broadcast")}
    assert counts == {"zmq": 2, "ipc": 1, "broadcast": 1}  # the failed load is not a sync
    assert engine.version == 5 and harness.ctx.policy_version == 5
