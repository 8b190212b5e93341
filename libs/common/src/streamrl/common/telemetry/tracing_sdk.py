"""The OpenTelemetry SDK behind :mod:`streamrl.common.telemetry.tracing`: provider, sampler, exporters, spans.

Imported only when tracing is on. One TracerProvider per process (not installed as the global
one: streamrl passes trace context explicitly, in messages), one BatchSpanProcessor in front of the
exporter, shut down by :meth:`SdkTracing.shutdown` or at interpreter exit.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Span as SdkSpanImpl
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.util.types import Attributes as OtelAttributes

from streamrl.common.errors import ConfigError
from streamrl.common.redact import redact_url
from streamrl.common.telemetry.spans import (
    SAMPLED,
    Attributes,
    AttributeValue,
    NullSpan,
    Span,
    Tracing,
    delivery_attempt,
    format_traceparent,
    keep_reasons,
    parse_traceparent,
)
from streamrl.common.telemetry.trace_file import JsonLinesSpanExporter
from streamrl.common.telemetry.trace_schema import ATTEMPT, KEEP, PER_STEP_ROOTS, RUN_ID
from streamrl.common.telemetry.tracing_config import TracingConfig

_EMPTY = Context()
"""Parent of a new trace: an empty context, never the thread's current one."""


def _context(parsed: tuple[int, int, int] | None) -> Context:
    if parsed is None:
        return _EMPTY
    trace_id, span_id, flags = parsed
    parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
    return trace_api.set_span_in_context(NonRecordingSpan(parent), _EMPTY)


def _links(traceparents: Iterable[str]) -> list[Link]:
    links = []
    for traceparent in traceparents:
        parsed = parse_traceparent(traceparent)
        if parsed is not None:
            trace_id, span_id, flags = parsed
            links.append(Link(SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))))
    return links


class _PerStepOr(Sampler):
    """Samples the per-step span names always, anything else as ``other`` decides."""

    def __init__(self, other: Sampler) -> None:
        self._other = other

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: trace_api.SpanKind | None = None,
        attributes: OtelAttributes = None,
        links: Sequence[Link] | None = None,
        trace_state: trace_api.TraceState | None = None,
    ) -> SamplingResult:
        if name in PER_STEP_ROOTS:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self._other.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"PerStepOr{{{self._other.get_description()}}}"


def sampler(config: TracingConfig) -> Sampler:
    """``all`` and ``tail``: every trace; ``ratio``: that fraction of new traces, per-step spans always;
    a span with a parent follows the parent's sampled flag."""
    if config.sampling == "ratio":
        return ParentBased(
            _PerStepOr(TraceIdRatioBased(config.ratio)),
            remote_parent_not_sampled=_PerStepOr(ALWAYS_OFF),
            local_parent_not_sampled=_PerStepOr(ALWAYS_OFF),
        )
    return ParentBased(ALWAYS_ON)


def build_exporter(config: TracingConfig, *, service: str, instance: str, run_dir: str | Path) -> SpanExporter:
    """The configured exporter; the OTLP ones read the ``OTEL_EXPORTER_OTLP_*`` variables themselves."""
    if config.exporter == "file":
        directory = Path(config.dir) if config.dir else Path(run_dir) / "traces"
        return JsonLinesSpanExporter(directory, f"{service}-{instance}")
    if config.exporter == "otlp-http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=config.endpoint.rstrip("/") + "/v1/traces" if config.endpoint else None)
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    except ImportError as e:
        raise ConfigError(
            "tracing.exporter: 'otlp-grpc' needs the gRPC exporter: pip install 'streamrl-common[otlp-grpc]'"
        ) from e
    return GrpcExporter(endpoint=config.endpoint)


class SdkSpan(Span):
    """A span of the SDK (recording, or not when its trace is unsampled)."""

    __slots__ = ("_config", "_ended", "_span")

    def __init__(self, span: trace_api.Span, config: TracingConfig) -> None:
        self._span = span
        self._config = config
        self._ended = False

    @property
    def traceparent(self) -> str:
        ctx = self._span.get_span_context()
        return format_traceparent(ctx.trace_id, ctx.span_id, ctx.trace_flags)

    def set(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def set_attributes(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def mark_keep(self, *, staleness: int | None = None, duration_s: float | None = None, failed: bool = False) -> None:
        reasons = keep_reasons(self._config, staleness=staleness, duration_s=duration_s, failed=failed)
        if not reasons or not self._span.is_recording():
            return
        assert isinstance(self._span, SdkSpanImpl)
        earlier = [r for r in str((self._span.attributes or {}).get(KEEP, "")).split(",") if r]
        self._span.set_attribute(KEEP, ",".join(earlier + [r for r in reasons if r not in earlier]))

    def fail(self, error: BaseException | str) -> None:
        if isinstance(error, BaseException) and not isinstance(error, Exception):  # cancelled: not a failure
            self._span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            return
        text = redact_url(f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error)
        self._span.set_status(Status(StatusCode.ERROR, text))
        if isinstance(error, BaseException):
            message = redact_url(str(error))
            self._span.add_event("exception", {"exception.type": type(error).__name__, "exception.message": message})
        self.mark_keep(failed=True)

    def end(self, end_s: float | None = None) -> None:
        if not self._ended:  # a span ended explicitly inside its ``with`` block stays as it was ended
            self._ended = True
            self._span.end(end_time=None if end_s is None else int(end_s * 1e9))


class SdkTracing(Tracing):
    """Spans of one process through its own TracerProvider."""

    def __init__(self, provider: TracerProvider, config: TracingConfig) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("streamrl")
        self._config = config

    @classmethod
    def start(
        cls,
        config: TracingConfig,
        *,
        service: str,
        instance: str,
        run_id: str,
        run_dir: str | Path,
        exporter: SpanExporter | None = None,
    ) -> SdkTracing:
        attributes: dict[str, str] = {SERVICE_INSTANCE_ID: instance, RUN_ID: run_id}
        if config.service_name or not os.environ.get("OTEL_SERVICE_NAME"):
            attributes[SERVICE_NAME] = config.service_name or f"streamrl-{service}"
        # a training step links every sample it consumed: no cap unless OTEL_SPAN_LINK_COUNT_LIMIT sets one
        max_links = None if "OTEL_SPAN_LINK_COUNT_LIMIT" in os.environ else SpanLimits.UNSET
        provider = TracerProvider(
            sampler=sampler(config), resource=Resource.create(attributes), span_limits=SpanLimits(max_links=max_links)
        )
        if exporter is None:
            exporter = build_exporter(config, service=service, instance=instance, run_dir=run_dir)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, config)

    def _attributes(self, attributes: Attributes | None) -> dict[str, AttributeValue] | Attributes | None:
        attempt = delivery_attempt()
        if not attempt:
            return attributes
        return {**(attributes or {}), ATTEMPT: attempt}

    def span(
        self,
        name: str,
        parent: str = "",
        *,
        attributes: Attributes | None = None,
        links: Iterable[str] = (),
        start_s: float | None = None,
    ) -> Span:
        parsed = parse_traceparent(parent) if parent else None
        if parsed is not None and not parsed[2] & SAMPLED and name not in PER_STEP_ROOTS:
            # left out where its trace started: what the SDK would do (a non-recording span) at a
            # tenth of the cost, passing the parent's context on unchanged
            return NullSpan(parent)
        span = self._tracer.start_span(
            name,
            context=_context(parsed),
            attributes=self._attributes(attributes),
            links=_links(links),
            start_time=None if start_s is None else int(start_s * 1e9),
            record_exception=False,
            set_status_on_exception=False,
        )
        return SdkSpan(span, self._config)

    def record(
        self,
        name: str,
        parent: str = "",
        *,
        start_s: float,
        end_s: float,
        attributes: Attributes | None = None,
        links: Iterable[str] = (),
        error: str | None = None,
    ) -> str:
        span = self.span(name, parent, attributes=attributes, links=links, start_s=start_s)
        if error is not None:
            span.fail(error)
        span.end(end_s)
        return span.traceparent

    def flush(self, timeout_s: float = 30.0) -> bool:
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self._provider.shutdown()
