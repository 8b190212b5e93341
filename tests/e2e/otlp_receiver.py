"""A small OTLP/HTTP trace receiver for tests: what a collector's ``otlp`` receiver does, in-process.

It listens on a free loopback port, takes ``POST /v1/traces`` bodies (protobuf, optionally gzip),
decodes each as an ``ExportTraceServiceRequest`` with ``opentelemetry-proto`` and keeps the spans
as :class:`streamrl.common.telemetry.trace_file.SpanRecord` (the records ``streamrl trace`` reads from files),
so a test can check the spans with the same report code::

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        ...
        spans = receiver.spans()
"""

from __future__ import annotations

import gzip
import http.server
import threading
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from streamrl.common.telemetry.trace_file import SpanRecord


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind is None:
        return None
    return getattr(value, kind)


def _attributes(items: list[KeyValue]) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


def span_records(request: ExportTraceServiceRequest) -> list[SpanRecord]:
    """The spans of one OTLP request, with the ``service.name`` of their resource."""
    records = []
    for resource_spans in request.resource_spans:
        service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                records.append(
                    SpanRecord(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attributes(s.attributes),
                        status=s.status.code,
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                        service=service,
                    )
                )
    return records


class OtlpReceiver:
    """An OTLP/HTTP receiver on ``127.0.0.1`` (a free port) serving in a daemon thread until closed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[SpanRecord] = []
        self.requests = 0
        """Export requests received."""
        self.bad_requests: list[str] = []
        """Why each refused request was refused (wrong path, undecodable body)."""
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                error = receiver._take(self.path, body)
                if error is not None:
                    self.send_error(400, error)
                    return
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                """Requests are not logged."""

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The base URL exporters are given (they append ``/v1/traces``)."""
        return f"http://127.0.0.1:{self._server.server_port}"

    def _take(self, path: str, body: bytes) -> str | None:
        if path != "/v1/traces":
            error = f"unexpected path {path}"
        else:
            request = ExportTraceServiceRequest()
            try:
                request.ParseFromString(body)
            except ValueError as e:  # protobuf's DecodeError is a ValueError
                error = f"undecodable body: {e}"
            else:
                with self._lock:
                    self.requests += 1
                    self._spans.extend(span_records(request))
                return None
        with self._lock:
            self.bad_requests.append(error)
        return error

    def spans(self) -> list[SpanRecord]:
        """Every span received so far."""
        with self._lock:
            return list(self._spans)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
