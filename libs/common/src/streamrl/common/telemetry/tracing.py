"""Tracing a trajectory across services with OpenTelemetry: the API services call.

The trace context rides in every message as a W3C ``traceparent`` string. A handler starts its
span from the incoming message's traceparent and writes the span's own traceparent into the
message it sends on, so one prompt group is one trace across processes (span names and attribute
keys: :mod:`streamrl.common.telemetry.trace_schema`)::

    tracing = setup_tracing(config.tracing, service="rollout", instance=instance,
                            run_id=config.run_id, run_dir=config.run_dir)
    queued = tracing.record(QUEUE, item.traceparent, start_s=item.issued_at, end_s=time.time())
    with tracing.span(GENERATE, queued, attributes={ENGINE: "vllm"}) as span:
        ...
        out = Trajectory(..., traceparent=span.traceparent)
    tracing.shutdown()   # on exit: flushes what is buffered

Each process has its own TracerProvider with a batch span processor; spans go to OTLP JSON lines
under ``{run_dir}/traces/`` (one file per process, :mod:`streamrl.common.telemetry.trace_file`) or to a
collector over OTLP HTTP / gRPC. Disabled, :func:`setup_tracing` returns :data:`NULL_TRACING`:
OpenTelemetry is not even imported and a span is one small object whose traceparent is the
parent's, passed through unchanged.

Sampling. The decision is made once, where the trace starts (the coordinator issuing a prompt),
and travels in the traceparent's sampled flag: every later span follows its parent, so a trace is
recorded whole or not at all and unsampled work costs a non-recording span (~2 us). ``ratio``
samples that fraction of prompt groups; the per-step spans (batch, step, weight publish / load)
are always recorded. ``tail`` ("only stale, slow or failed samples") cannot be decided where the
trace starts: whether a sample is stale is known only when it is trained, in another process,
after the spans of the issuing, generating and scoring processes have ended. Dropping at the
source would need every process to hold its spans until a verdict reached it, and the bus carries
messages forward only. So under ``tail`` every span is recorded and exported; the span that sees
the evidence (a training span of a stale sample, a failed reward attempt, a trajectory over
``tail_slow_s``) marks it with ``streamrl.keep`` (:meth:`Span.mark_keep`), and the sink keeps
whole traces holding a mark: ``streamrl trace --kept`` for files, a collector's ``tail_sampling``
processor (``string_attribute`` policy on ``streamrl.keep``) for OTLP. Tail sampling saves storage
and attention, not the services' CPU; ``ratio`` saves CPU.

Redelivery. The consumer loop calls :func:`set_delivery_attempt` before each handler call; every
span started while handling that delivery carries ``streamrl.attempt``. A redelivered entry has
the same traceparent, so its attempts are sibling spans under one parent; only the attempt whose
outputs were committed passes its traceparent on (the commit de-duplicates), so the rest of the
trajectory hangs under that one attempt and is never duplicated.

The span model (:class:`Span`, :class:`Tracing`, the no-op pair, traceparent helpers) is defined in
:mod:`streamrl.common.telemetry.spans` and re-exported here; the OpenTelemetry implementation is
:mod:`streamrl.common.telemetry.tracing_sdk`, imported by :func:`setup_tracing` only when tracing is
on. Both import the span model and never this module, so the three form no import circle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.common.telemetry.spans import (
    NULL_TRACING as NULL_TRACING,
)
from streamrl.common.telemetry.spans import (
    SAMPLED as SAMPLED,
)
from streamrl.common.telemetry.spans import (
    Attributes as Attributes,
)
from streamrl.common.telemetry.spans import (
    AttributeValue as AttributeValue,
)
from streamrl.common.telemetry.spans import (
    NullSpan as NullSpan,
)
from streamrl.common.telemetry.spans import (
    NullTracing as NullTracing,
)
from streamrl.common.telemetry.spans import (
    Span as Span,
)
from streamrl.common.telemetry.spans import (
    Tracing as Tracing,
)
from streamrl.common.telemetry.spans import (
    delivery_attempt as delivery_attempt,
)
from streamrl.common.telemetry.spans import (
    format_traceparent as format_traceparent,
)
from streamrl.common.telemetry.spans import (
    keep_reasons as keep_reasons,
)
from streamrl.common.telemetry.spans import (
    parse_traceparent as parse_traceparent,
)
from streamrl.common.telemetry.spans import (
    set_delivery_attempt as set_delivery_attempt,
)
from streamrl.common.telemetry.spans import (
    weights_traceparent as weights_traceparent,
)
from streamrl.common.telemetry.tracing_config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter


def setup_tracing(
    config: TracingConfig,
    *,
    service: str,
    instance: str,
    run_id: str,
    run_dir: str | Path,
    exporter: SpanExporter | None = None,
) -> Tracing:
    """This process's tracing: :data:`NULL_TRACING` when ``config.enabled`` is off (or
    ``OTEL_SDK_DISABLED=true``), else a TracerProvider exporting as configured (``exporter``
    replaces the configured one: tests pass the SDK's in-memory exporter)."""
    if not config.enabled or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return NULL_TRACING
    from streamrl.common.telemetry.tracing_sdk import SdkTracing

    return SdkTracing.start(
        config, service=service, instance=instance, run_id=run_id, run_dir=run_dir, exporter=exporter
    )
