"""Spans as OTLP JSON lines on disk: the exporter services write with, and the reader ``streamrl trace`` uses.

Each line is one OTLP ``ExportTraceServiceRequest`` in the OTLP/JSON encoding (the format of the
collector's file exporter and ``otlpjsonfile`` receiver: camelCase fields, hex trace and span ids,
64-bit integers as strings, enums as numbers)::

    {"resourceSpans": [{"resource": {"attributes": [...]},
                        "scopeSpans": [{"scope": {"name": "streamrl"}, "spans": [{"traceId": "5b8e...", ...}]}]}]}

The SDK's OTLP encoder produces protobuf messages only (and protobuf's own JSON mapping writes ids
in base64, which OTLP/JSON forbids), so the shape is written here. Every process appends to its own
file, ``{prefix}-{pid}.jsonl``, so several processes share a folder without interleaving; a forked
child opens its own file at its first export.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger(__name__)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
"""Bits 8 and 9 of the OTLP ``flags`` of a span (its parent) and of a link: is-remote known / is remote."""
_ENCODER = msgspec.json.Encoder()


def _value(value: Any) -> dict[str, Any]:
    kind = type(value)  # exact types first: this runs for every attribute of every span
    if kind is str:
        return {"stringValue": value}
    if kind is bool:
        return {"boolValue": value}
    if kind is int:
        return {"intValue": str(value)}
    if kind is float:
        if math.isfinite(value):
            return {"doubleValue": value}
        return {"doubleValue": "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")}
    if kind is tuple or kind is list:
        return {"arrayValue": {"values": [_value(v) for v in value]}}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode()}
    for base in (bool, int, float, str):  # a subclass (an IntEnum member): as its base type
        if isinstance(value, base):
            return _value(base(value))
    return {"stringValue": str(value)}


def _attributes(attributes: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return [{"key": key, "value": _value(value)} for key, value in (attributes or {}).items()]


def _remote_flags(trace_flags: int, is_remote: bool) -> int:
    return trace_flags | _HAS_IS_REMOTE | (_IS_REMOTE if is_remote else 0)


def _span(span: ReadableSpan) -> dict[str, Any]:
    """One SDK span in OTLP/JSON."""
    ctx = span.context
    out: dict[str, Any] = {
        "traceId": f"{ctx.trace_id:032x}",
        "spanId": f"{ctx.span_id:016x}",
        "name": span.name,
        "kind": span.kind.value + 1,  # the SDK counts from INTERNAL = 0, OTLP from UNSPECIFIED = 0
        "startTimeUnixNano": str(span.start_time),
        "endTimeUnixNano": str(span.end_time),
        "attributes": _attributes(span.attributes),
    }
    if span.parent is not None:
        out["parentSpanId"] = f"{span.parent.span_id:016x}"
        out["flags"] = _remote_flags(int(ctx.trace_flags), span.parent.is_remote)
    if span.events:
        out["events"] = [
            {"timeUnixNano": str(e.timestamp), "name": e.name, "attributes": _attributes(e.attributes)}
            for e in span.events
        ]
    if span.links:
        out["links"] = [
            {
                "traceId": f"{link.context.trace_id:032x}",
                "spanId": f"{link.context.span_id:016x}",
                "attributes": _attributes(link.attributes),
                "flags": _remote_flags(int(link.context.trace_flags), link.context.is_remote),
            }
            for link in span.links
        ]
    if span.status.status_code.value:  # UNSET = 0, OK = 1, ERROR = 2: the same numbers in OTLP
        out["status"] = {"code": span.status.status_code.value, "message": span.status.description or ""}
    return out


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """One ``ExportTraceServiceRequest`` in OTLP/JSON (no newline) holding ``spans``."""
    resources: dict[int, tuple[Any, dict[tuple[str, str], list[dict[str, Any]]]]] = {}
    for span in spans:
        _, scopes = resources.setdefault(id(span.resource), (span.resource, {}))
        scope = span.instrumentation_scope
        key = (scope.name, scope.version or "") if scope is not None else ("", "")
        scopes.setdefault(key, []).append(_span(span))
    request = {
        "resourceSpans": [
            {
                "resource": {"attributes": _attributes(resource.attributes)},
                "scopeSpans": [
                    {"scope": {"name": name, "version": version}, "spans": encoded}
                    for (name, version), encoded in scopes.items()
                ],
            }
            for resource, scopes in resources.values()
        ]
    }
    return _ENCODER.encode(request)


class JsonLinesSpanExporter(SpanExporter):
    """A span exporter appending OTLP/JSON lines to ``{directory}/{prefix}-{pid}.jsonl``: one line per batch of spans."""

    def __init__(self, directory: str | Path, prefix: str) -> None:
        self.directory = Path(directory)
        self.prefix = _UNSAFE.sub("_", prefix)
        self._file: IO[bytes] | None = None
        self._pid = 0
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        """The file this process writes."""
        return self.directory / f"{self.prefix}-{os.getpid()}.jsonl"

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = encode_spans(spans) + b"\n"
        with self._lock:
            if self._file is None or self._pid != os.getpid():
                self.directory.mkdir(parents=True, exist_ok=True)
                self._file, self._pid = open(self.path, "ab"), os.getpid()
            try:
                self._file.write(line)
                self._file.flush()
            except OSError as e:
                logger.warning("could not write %d spans to %s: %s", len(spans), self.path, e)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None and self._pid == os.getpid():
                self._file.close()
            self._file = None


@dataclass(frozen=True)
class SpanRecord:
    """One span read back from a trace file."""

    trace_id: str
    span_id: str
    parent_id: str
    """Empty for a root span."""
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status: int = 0
    """0 unset, 1 ok, 2 error."""
    links: tuple[tuple[str, str], ...] = ()
    """(trace id, span id) of each linked span."""
    service: str = ""
    """``service.name`` of the process that recorded it."""

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _decode_value(value: Mapping[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_decode_value(v) for v in value["arrayValue"].get("values", [])]
    if "bytesValue" in value:
        return base64.b64decode(value["bytesValue"])
    return None


def _decode_attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {item["key"]: _decode_value(item.get("value", {})) for item in items or []}


def decode_request(line: bytes | str) -> list[SpanRecord]:
    """The spans of one OTLP/JSON ``ExportTraceServiceRequest``; :class:`msgspec.DecodeError` if it is not JSON."""
    request = msgspec.json.decode(line)
    records = []
    for resource_spans in request.get("resourceSpans", []):
        resource = _decode_attributes(resource_spans.get("resource", {}).get("attributes"))
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for s in scope_spans.get("spans", []):
                records.append(
                    SpanRecord(
                        trace_id=s["traceId"],
                        span_id=s["spanId"],
                        parent_id=s.get("parentSpanId", ""),
                        name=s["name"],
                        start_ns=int(s["startTimeUnixNano"]),
                        end_ns=int(s["endTimeUnixNano"]),
                        attributes=_decode_attributes(s.get("attributes")),
                        status=int(s.get("status", {}).get("code", 0)),
                        links=tuple((link["traceId"], link["spanId"]) for link in s.get("links", [])),
                        service=service,
                    )
                )
    return records


def trace_files(path: str | Path) -> list[Path]:
    """The ``*.jsonl`` trace files of a run folder (its ``traces/`` subfolder) or of a traces folder."""
    path = Path(path)
    folder = path / "traces" if (path / "traces").is_dir() else path
    return sorted(folder.glob("*.jsonl"))


def read_spans(path: str | Path) -> tuple[list[SpanRecord], int]:
    """Every span under ``path`` (see :func:`trace_files`) and the number of lines that could not be
    read (a process killed mid-write leaves its last line cut)."""
    spans: list[SpanRecord] = []
    bad = 0
    for file in trace_files(path):
        with open(file, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    spans.extend(decode_request(line))
                except (msgspec.DecodeError, KeyError, ValueError, TypeError, AttributeError):
                    bad += 1
    return spans, bad
