"""The span model of :mod:`streamrl.common.telemetry.tracing`: what a span and a tracer are, and the
no-op pair used when tracing is off.

* :class:`Span` / :class:`Tracing`: the interface services call (start, record, mark for tail
  sampling, fail, end; flush, shut down); :class:`NullSpan` / :data:`NULL_TRACING` record nothing
  and pass the parent's traceparent on unchanged.
* W3C ``traceparent`` strings: :func:`parse_traceparent`, :func:`format_traceparent`, and
  :func:`weights_traceparent` (the shared parent of a weight version's spans).
* The delivery attempt of the entry a task handles (:func:`set_delivery_attempt`), and
  :func:`keep_reasons` (why tail sampling keeps a sample).

The OpenTelemetry implementation (:mod:`streamrl.common.telemetry.tracing_sdk`) builds on this
module; :func:`streamrl.common.telemetry.tracing.setup_tracing` picks one of the two. Nothing here
imports OpenTelemetry.
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from types import TracebackType

from streamrl.common.telemetry.tracing_config import TracingConfig

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
