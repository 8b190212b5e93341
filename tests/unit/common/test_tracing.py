"""Tracing across services: one trace per prompt group through the real messages, redelivery, sampling, export.

Each simulated service has its own TracerProvider and the SDK's in-memory exporter, as separate
processes would; the trace context travels only as the messages' ``traceparent`` fields,
encoded and decoded by the real codec at every hop.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator

import pytest
from msgspec.structs import replace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from streamrl.common.codec import decode, encode
from streamrl.common.config import validate
from streamrl.common.errors import ConfigError
from streamrl.common.messages import PromptWorkItem, ScoredTrajectory, Tensor, TrainingBatch, Trajectory
from streamrl.common.telemetry.trace_schema import (
    ATTEMPT,
    BATCH,
    BATCH_WAIT,
    GENERATE,
    GROUP_WAIT,
    ISSUE,
    KEEP,
    QUEUE,
    REWARD,
    STALENESS,
    STEP,
    TRAIN,
    TRAJECTORY_ID,
    WEIGHTS_LOAD,
    WEIGHTS_PUBLISH,
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

T0 = 1_000.0
"""Start of the simulated run (Unix time, s)."""


class Service:
    """One simulated service process: its own provider, exporting into memory."""

    def __init__(self, name: str, config: TracingConfig | None = None) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracing: Tracing = setup_tracing(
            config or TracingConfig(sampling="all"),
            service=name,
            instance=f"{name}-0",
            run_id="r1",
            run_dir="unused",
            exporter=self.exporter,
        )

    def spans(self) -> list[ReadableSpan]:
        assert self.tracing.flush()
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def services() -> Iterator[dict[str, Service]]:
    made = {name: Service(name) for name in ("coordinator", "rollout", "reward", "learner")}
    yield made
    for service in made.values():
        service.tracing.shutdown()


def hop(message: object, cls: type) -> object:
    """Through the wire: what the next service decodes."""
    return decode(encode(message), cls)  # type: ignore[arg-type]


def trajectory(item: PromptWorkItem, index: int, traceparent: str) -> Trajectory:
    return Trajectory(
        id=f"{item.id}/{index}",
        group_id=item.id,
        group_index=index,
        group_size=2,
        prompt_ids=item.prompt_ids,
        response_ids=Tensor.from_list([5, 6], "int32"),
        logprobs=Tensor.from_list([-0.5, -0.5], "float32"),
        loss_mask=Tensor.from_list([1, 1], "uint8"),
        policy_version_start=0,
        policy_version_end=0,
        traceparent=traceparent,
    )


def run_pipeline(s: dict[str, Service], *, versions_behind: tuple[int, int] = (0, 2)) -> list[str]:
    """One prompt group of two samples, coordinator -> rollout -> reward -> coordinator -> learner.
    Returns the traceparents the training batch carried for its samples."""
    coordinator, rollout, reward, learner = (s[n].tracing for n in ("coordinator", "rollout", "reward", "learner"))
    with coordinator.span(ISSUE, start_s=T0) as issue:
        item = PromptWorkItem(
            id="p1", prompt_ids=Tensor.from_list([1, 2], "int32"), issued_at=T0, traceparent=issue.traceparent
        )
    item = hop(item, PromptWorkItem)
    queued = rollout.record(QUEUE, item.traceparent, start_s=item.issued_at, end_s=T0 + 0.01)
    trajectories = []
    for i in range(2):
        with rollout.span(GENERATE, queued, attributes={TRAJECTORY_ID: f"p1/{i}"}) as gen:
            trajectories.append(hop(trajectory(item, i, gen.traceparent), Trajectory))
    scored = []
    for t in trajectories:
        with reward.span(REWARD, t.traceparent) as span:
            scored.append(
                hop(ScoredTrajectory(trajectory=t, reward=1.0, traceparent=span.traceparent), ScoredTrajectory)
            )
    in_batch = []
    for sample in scored:
        waited = coordinator.record(GROUP_WAIT, sample.traceparent, start_s=T0 + 1, end_s=T0 + 2)
        in_batch.append(
            replace(sample, traceparent=coordinator.record(BATCH_WAIT, waited, start_s=T0 + 2, end_s=T0 + 3))
        )
    with coordinator.span(BATCH) as batch_span:
        batch = TrainingBatch(
            id="batch-0",
            index=0,
            samples=in_batch,
            policy_version=2,
            staleness=list(versions_behind),
            traceparent=batch_span.traceparent,
        )
    batch = hop(batch, TrainingBatch)
    with learner.span(STEP, batch.traceparent, links=[x.traceparent for x in batch.samples]):
        for sample, staleness in zip(batch.samples, batch.staleness, strict=True):
            with learner.span(TRAIN, sample.traceparent, attributes={STALENESS: staleness}) as span:
                span.mark_keep(staleness=staleness)
    return [x.traceparent for x in batch.samples]


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [x for x in spans if x.name == name]


def test_a_trajectory_is_one_trace_across_the_four_services(services: dict[str, Service]) -> None:
    batch_traceparents = run_pipeline(services)
    spans = [x for s in services.values() for x in s.spans()]
    by_id = {x.context.span_id: x for x in spans}
    (issue,) = by_name(spans, ISSUE)
    sample_trace = {x for x in spans if x.context.trace_id == issue.context.trace_id}
    assert {x.name for x in sample_trace} == {ISSUE, QUEUE, GENERATE, REWARD, GROUP_WAIT, BATCH_WAIT, TRAIN}
    assert len(sample_trace) == 1 + 1 + 2 * 5  # issue and queue once, five spans per sample
    chain = [ISSUE, QUEUE, GENERATE, REWARD, GROUP_WAIT, BATCH_WAIT, TRAIN]
    for train in by_name(spans, TRAIN):
        path, span = [], train
        while span.parent is not None:
            assert span.parent.is_remote  # every hop passed a traceparent string
            path.append(span.name)
            span = by_id[span.parent.span_id]
        assert [span.name, *path[::-1]] == chain
    assert issue.parent is None
    assert sorted(x.attributes[TRAJECTORY_ID] for x in by_name(spans, GENERATE)) == ["p1/0", "p1/1"]
    assert sorted(x.attributes[STALENESS] for x in by_name(spans, TRAIN)) == [0, 2]
    services_of = {x.name: x.resource.attributes["service.name"] for x in spans}
    assert services_of[ISSUE] == "streamrl-coordinator" and services_of[GENERATE] == "streamrl-rollout"
    assert services_of[REWARD] == "streamrl-reward" and services_of[TRAIN] == "streamrl-learner"
    # the step is in the batch's trace and links the very spans whose traceparents the batch carried
    (step,) = by_name(spans, STEP)
    (batch,) = by_name(spans, BATCH)
    assert step.parent is not None and step.parent.span_id == batch.context.span_id
    assert step.context.trace_id != issue.context.trace_id
    linked = [format_traceparent(x.context.trace_id, x.context.span_id, x.context.trace_flags) for x in step.links]
    assert linked == batch_traceparents
    assert [by_id[x.context.span_id].name for x in step.links] == [BATCH_WAIT, BATCH_WAIT]
    # tail sampling marks: the sample 2 versions behind is stale (tail_min_staleness = 2), the other is not
    marks = {x.attributes[STALENESS]: x.attributes.get(KEEP) for x in by_name(spans, TRAIN)}
    assert marks == {0: None, 2: "stale"}


async def deliver(handler: object, attempts: list[int]) -> None:
    """What the consumer loop does for one entry, in its own task: a delivery, a failure, the next delivery."""
    for attempt in attempts:
        set_delivery_attempt(attempt)
        try:
            await handler()  # type: ignore[operator]
            return
        except RuntimeError:
            continue


def test_a_redelivered_entry_gets_one_span_per_attempt_under_one_parent(services: dict[str, Service]) -> None:
    rollout, reward, coordinator = (services[n].tracing for n in ("rollout", "reward", "coordinator"))
    with rollout.span(GENERATE) as gen:
        entries = {"a": gen.traceparent}
    with rollout.span(GENERATE) as other:
        entries["b"] = other.traceparent
    committed: dict[str, str] = {}

    def handler_for(key: str, failures: int) -> object:
        calls = 0

        async def handle() -> None:
            nonlocal calls
            calls += 1
            with reward.span(REWARD, entries[key]) as span:
                await asyncio.sleep(0)  # the other entry's task runs meanwhile
                if calls <= failures:
                    raise RuntimeError("scorer down")
                committed[key] = span.traceparent  # only the committed attempt's traceparent goes on

        return handle

    async def main() -> None:
        await asyncio.gather(deliver(handler_for("a", 2), [1, 2, 3]), deliver(handler_for("b", 0), [1]))

    asyncio.run(main())
    for traceparent in committed.values():
        coordinator.record(GROUP_WAIT, traceparent, start_s=T0, end_s=T0 + 1)
    spans = [x for s in services.values() for x in s.spans()]
    a_parent = parse_traceparent(entries["a"])
    assert a_parent is not None
    attempts = sorted(
        (x for x in by_name(spans, REWARD) if x.parent is not None and x.parent.span_id == a_parent[1]),
        key=lambda x: x.attributes[ATTEMPT],
    )
    assert [x.attributes[ATTEMPT] for x in attempts] == [1, 2, 3]
    assert [x.status.status_code.name for x in attempts] == ["ERROR", "ERROR", "UNSET"]
    assert [x.attributes.get(KEEP) for x in attempts] == ["failed", "failed", None]
    assert attempts[0].status.description == "RuntimeError: scorer down"
    # the rest of the trajectory hangs under the attempt that committed, once
    children = [x for x in spans if x.parent is not None and x.parent.span_id in {a.context.span_id for a in attempts}]
    assert [(x.name, x.parent.span_id) for x in children] == [(GROUP_WAIT, attempts[2].context.span_id)]  # type: ignore[union-attr]
    (b_attempt,) = [x for x in by_name(spans, REWARD) if x not in attempts]
    assert b_attempt.attributes[ATTEMPT] == 1  # the concurrent task kept its own attempt number


def sampled(traceparent: str) -> bool:
    parsed = parse_traceparent(traceparent)
    assert parsed is not None
    return bool(parsed[2] & SAMPLED)


def test_ratio_sampling_is_decided_at_the_root_and_followed_downstream() -> None:
    service = Service("coordinator", TracingConfig(sampling="ratio", ratio=0.25))
    tracing = service.tracing
    roots = [tracing.record(ISSUE, start_s=T0, end_s=T0 + 1) for _ in range(4000)]
    kept = [tp for tp in roots if sampled(tp)]
    assert 0.21 < len(kept) / len(roots) < 0.29
    unsampled = next(tp for tp in roots if not sampled(tp))
    child = tracing.record(GENERATE, unsampled, start_s=T0, end_s=T0 + 1)
    assert child == unsampled  # not recorded: the context is passed on unchanged
    assert sampled(tracing.record(GENERATE, kept[0], start_s=T0, end_s=T0 + 1))
    assert sampled(tracing.record(STEP, unsampled, start_s=T0, end_s=T0 + 1))  # per-step spans: always recorded
    spans = service.spans()
    assert len(by_name(spans, ISSUE)) == len(kept)
    assert len(by_name(spans, GENERATE)) == 1 and len(by_name(spans, STEP)) == 1
    tracing.shutdown()


def test_weight_spans_of_one_version_share_a_parent_in_every_process() -> None:
    learner, rollout = Service("learner"), Service("rollout")
    assert weights_traceparent("r1", 3) == weights_traceparent("r1", 3)
    assert weights_traceparent("r1", 3) != weights_traceparent("r1", 4) != weights_traceparent("r2", 4)
    learner.tracing.record(WEIGHTS_PUBLISH, weights_traceparent("r1", 3), start_s=T0, end_s=T0 + 0.1)
    for _ in range(2):
        rollout.tracing.record(WEIGHTS_LOAD, weights_traceparent("r1", 3), start_s=T0 + 0.1, end_s=T0 + 0.2)
    spans = learner.spans() + rollout.spans()
    assert len({(x.context.trace_id, x.parent.span_id) for x in spans if x.parent is not None}) == 1
    assert len(spans) == 3
    learner.tracing.shutdown()
    rollout.tracing.shutdown()


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1),
        ),
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
            (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 0),
        ),
        (
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-later",
            (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1),
        ),
        ("", None),
        ("00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01", None),  # upper case is invalid
        ("00-00000000000000000000000000000000-b7ad6b7169203331-01", None),  # zero trace id
        ("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", None),  # zero span id
        ("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", None),  # forbidden version
        ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x", None),  # version 00 is 55 characters
        ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01", None),
        ("00-0af7651916cd43dd8448eb2_1c80319c-b7ad6b7169203331-01", None),
    ],
)
def test_traceparent_parsing(value: str, parsed: tuple[int, int, int] | None) -> None:
    assert parse_traceparent(value) == parsed
    if parsed is not None and value.startswith("00"):
        assert format_traceparent(*parsed) == value


def test_a_malformed_traceparent_starts_a_new_trace() -> None:
    service = Service("reward")
    traceparent = service.tracing.record(REWARD, "garbage", start_s=T0, end_s=T0 + 1)
    (span,) = service.spans()
    assert span.parent is None and parse_traceparent(traceparent) is not None
    service.tracing.shutdown()


def test_keep_marks_follow_the_thresholds() -> None:
    service = Service("learner", TracingConfig(sampling="tail", tail_min_staleness=3, tail_slow_s=10.0))
    with service.tracing.span(TRAIN) as fresh:
        fresh.mark_keep(staleness=2, duration_s=9.9)
    with service.tracing.span(TRAIN) as both:
        both.mark_keep(staleness=3)
        both.mark_keep(duration_s=10.0)
        both.mark_keep(staleness=5)
    with pytest.raises(ValueError), service.tracing.span(TRAIN):
        raise ValueError("bad batch")
    keeps = [x.attributes.get(KEEP) for x in service.spans()]
    assert keeps == [None, "stale,slow", "failed"]
    service.tracing.shutdown()


def test_otel_sdk_disabled_turns_tracing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    tracing = setup_tracing(TracingConfig(), service="s", instance="i", run_id="r", run_dir="x")
    assert tracing is NULL_TRACING


def test_bad_tracing_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match="ratio"):
        validate(TracingConfig, {"ratio": 0})
    with pytest.raises(ConfigError, match="sampling"):
        validate(TracingConfig, {"sampling": "some"})
    with pytest.raises(ConfigError, match="exporter"):
        validate(TracingConfig, {"exporter": "zipkin"})


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: decodes each request body as a protobuf ExportTraceServiceRequest."""

    received: list[tuple[str, ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.received.append((self.path, request))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize("via", ["env", "config"])
def test_otlp_http_export_reaches_a_receiver(via: str, monkeypatch: pytest.MonkeyPatch) -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Receiver.received = []
    url = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url if via == "env" else "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    config = TracingConfig(sampling="all", exporter="otlp-http", endpoint=url if via == "config" else None)
    tracing = setup_tracing(config, service="reward", instance="r-0", run_id="r1", run_dir="unused")
    traceparent = tracing.record(REWARD, start_s=T0, end_s=T0 + 0.5, attributes={STALENESS: 1})
    tracing.shutdown()
    server.shutdown()
    server.server_close()
    ((path, request),) = _Receiver.received
    assert path == "/v1/traces"
    (resource_spans,) = request.resource_spans
    service_name = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
    assert service_name == "from-env"
    (span,) = resource_spans.scope_spans[0].spans
    assert span.name == REWARD and span.span_id.hex() == traceparent.split("-")[2]
    assert span.end_time_unix_nano - span.start_time_unix_nano == 500_000_000


def test_otlp_grpc_export_reaches_a_plaintext_receiver_at_an_http_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gRPC form tracing.endpoint documents for a collector without TLS (``http://host:4317``);
    a bare ``host:4317`` would make the exporter speak TLS and fail every handshake."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc", reason="the otlp-grpc extra is not installed")
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[ExportTraceServiceRequest] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: ExportTraceServiceRequest, context: object) -> object:  # noqa: N802 (gRPC's name)
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_INSECURE", raising=False)
    config = TracingConfig(sampling="all", exporter="otlp-grpc", endpoint=f"http://127.0.0.1:{port}")
    tracing = setup_tracing(config, service="learner", instance="l-0", run_id="r1", run_dir="unused")
    traceparent = tracing.record(TRAIN, start_s=T0, end_s=T0 + 0.25, attributes={STALENESS: 2})
    tracing.shutdown()
    server.stop(0)
    (request,) = received
    (span,) = request.resource_spans[0].scope_spans[0].spans
    assert span.name == TRAIN and span.span_id.hex() == traceparent.split("-")[2]
    assert {a.key: a.value.int_value for a in span.attributes}[STALENESS] == 2
