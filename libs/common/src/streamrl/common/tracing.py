"""Tracing a trajectory across services with OpenTelemetry: the API services call.

The trace context rides in every message as a W3C ``traceparent`` string. A handler starts its
span from the incoming message's traceparent and writes the span's own traceparent into the
message it sends on, so one prompt group is one trace across processes (span names and attribute
keys: :mod:`streamrl.common.trace_schema`)::

    tracing = setup_tracing(config.tracing, service="rollout", instance=instance,
                            run_id=config.run_id, run_dir=config.run_dir)
    queued = tracing.record(QUEUE, item.traceparent, start_s=item.issued_at, end_s=time.time())
    with tracing.span(GENERATE, queued, attributes={ENGINE: "vllm"}) as span:
        ...
        out = Trajectory(..., traceparent=span.traceparent)
    tracing.shutdown()   # on exit: flushes what is buffered

Each process has its own TracerProvider with a batch span processor; spans go to OTLP JSON lines
under ``{run_dir}/traces/`` (one file per process, :mod:`streamrl.common.trace_file`) or to a
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
"""

from __future__ import annotations

import hashlib
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from streamrl.common.tracing_config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

AttributeValue = str | bool | int | float | list[str] | list[int] | list[float]
Attributes = Mapping[str, AttributeValue]

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
SAMPLED = 0x01
"""The sampled bit of the traceparent's trace flags."""
_ATTEMPT: ContextVar[int] = ContextVar("streamrl_delivery_attempt", default=0)


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """``(trace_id, span_id, flags)`` of a W3C traceparent, or None when empty or malformed (a new trace starts)."""
    match = _TRACEPARENT.fullmatch(value[:55]) if len(value) >= 55 else None
    if match is None or match[1] == "ff":
        return None
    if len(value) > 55 and (match[1] == "00" or value[55] != "-"):  # version 00 has exactly 55 characters
        return None
    trace_id, span_id = int(match[2], 16), int(match[3], 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(match[4], 16)


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The W3C traceparent (version 00) of a span."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def weights_traceparent(run_id: str, version: int) -> str:
    """The parent of weight version ``version``'s publish and load spans, computed the same in every process.

    ``WeightsPublished`` carries no traceparent, so the learner's publish span and every worker's
    load span of a version hang under one context derived from (run, version); that parent span is
    never emitted itself.
    """
    digest = hashlib.blake2b(f"{run_id}/weights/{version}".encode(), digest_size=24).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:], "big") or 1
    return format_traceparent(trace_id, span_id, SAMPLED)


def set_delivery_attempt(attempt: int) -> None:
    """Record the delivery attempt (1 = first) of the entry this asyncio task handles; spans started
    in the task from now on carry it as ``streamrl.attempt``. The consumer loop calls this."""
    _ATTEMPT.set(attempt)


def delivery_attempt() -> int:
    """The attempt set by :func:`set_delivery_attempt` in this task, 0 when none."""
    return _ATTEMPT.get()


def keep_reasons(
    config: TracingConfig, *, staleness: int | None = None, duration_s: float | None = None, failed: bool = False
) -> list[str]:
    """Why a sample is worth keeping under tail sampling: ``failed``, ``stale``, ``slow``; empty if not."""
    reasons = []
    if failed:
        reasons.append("failed")
    if staleness is not None and staleness >= config.tail_min_staleness:
        reasons.append("stale")
    if duration_s is not None and duration_s >= config.tail_slow_s:
        reasons.append("slow")
    return reasons


class Span(ABC):
    """One span being recorded; also a context manager that ends it (an exception marks it failed)."""

    @property
    @abstractmethod
    def traceparent(self) -> str:
        """This span's W3C traceparent: put it in the message sent on."""

    @abstractmethod
    def set(self, key: str, value: AttributeValue) -> None:
        """Set one attribute."""

    @abstractmethod
    def set_attributes(self, attributes: Attributes) -> None:
        """Set several attributes."""

    @abstractmethod
    def mark_keep(self, *, staleness: int | None = None, duration_s: float | None = None, failed: bool = False) -> None:
        """Mark the trace for tail sampling when the figures call for it (``streamrl.keep``)."""

    @abstractmethod
    def fail(self, error: BaseException | str) -> None:
        """Mark the span failed (status ERROR, kept under tail sampling)."""

    @abstractmethod
    def end(self, end_s: float | None = None) -> None:
        """End the span, now or at ``end_s`` (Unix time, s); later calls change nothing."""

    def __enter__(self) -> Span:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self.fail(exc)
        self.end()


class Tracing(ABC):
    """Starts spans of one process; :data:`NULL_TRACING` when tracing is off."""

    @abstractmethod
    def span(
        self,
        name: str,
        parent: str = "",
        *,
        attributes: Attributes | None = None,
        links: Iterable[str] = (),
        start_s: float | None = None,
    ) -> Span:
        """Start a span, child of the ``parent`` traceparent (a new trace when empty), now or at
        ``start_s`` (Unix time, s), linked to the spans whose traceparents are in ``links``."""

    @abstractmethod
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
        """Record a span that already happened (a wait, one sample of a batched call); returns its traceparent."""

    @abstractmethod
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Export what is buffered; False if it did not finish within ``timeout_s``."""

    @abstractmethod
    def shutdown(self) -> None:
        """Flush and stop exporting (call once, on exit)."""


class NullSpan(Span):
    """A span that records nothing; its traceparent is the parent's, passed on unchanged."""

    __slots__ = ("_traceparent",)

    def __init__(self, traceparent: str) -> None:
        self._traceparent = traceparent

    @property
    def traceparent(self) -> str:
        return self._traceparent

    def set(self, key: str, value: AttributeValue) -> None:
        pass

    def set_attributes(self, attributes: Attributes) -> None:
        pass

    def mark_keep(self, *, staleness: int | None = None, duration_s: float | None = None, failed: bool = False) -> None:
        pass

    def fail(self, error: BaseException | str) -> None:
        pass

    def end(self, end_s: float | None = None) -> None:
        pass


class NullTracing(Tracing):
    """Tracing off: every call returns at once."""

    def span(
        self,
        name: str,
        parent: str = "",
        *,
        attributes: Attributes | None = None,
        links: Iterable[str] = (),
        start_s: float | None = None,
    ) -> Span:
        return NullSpan(parent)

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
        return parent

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self) -> None:
        pass


NULL_TRACING = NullTracing()


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
    from streamrl.common.tracing_sdk import SdkTracing

    return SdkTracing.start(
        config, service=service, instance=instance, run_id=run_id, run_dir=run_dir, exporter=exporter
    )
