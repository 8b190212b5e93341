"""``[tracing]``: whether and how a service traces trajectories with OpenTelemetry.

Torch- and OpenTelemetry-free (pydantic only), so a recipe is validated before anything is set up;
:mod:`streamrl.common.telemetry.tracing` acts on it. Standard ``OTEL_*`` environment variables still apply
where this section leaves a value unset (endpoint, headers, service name, batch processor sizes),
and ``OTEL_SDK_DISABLED=true`` turns tracing off.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from streamrl.common.config import BaseConfig


class TracingConfig(BaseConfig):
    """One trace per prompt group across every service; see :mod:`streamrl.common.telemetry.tracing`."""

    enabled: bool = True
    """Record spans. Off: no OpenTelemetry object is created and every tracing call returns at once."""
    sampling: Literal["all", "ratio", "tail"] = "ratio"
    """Which prompt groups are traced. ``all``: every one. ``ratio``: a fraction ``ratio`` of them,
    decided once when the coordinator issues the prompt and carried to every service in the
    traceparent's sampled flag; per-step spans (batch, training step, weight publish and loads) are
    always recorded. ``tail``: every span is recorded and exported as with ``all``; a span that sees
    a stale, slow or failed sample marks it (attribute ``streamrl.keep``) and the sink keeps the
    marked traces whole (``streamrl trace --kept``; a collector's ``tail_sampling`` processor)."""
    ratio: float = Field(0.1, gt=0, le=1)
    """Fraction of prompt groups traced with ``sampling = "ratio"``."""
    tail_min_staleness: int = Field(2, ge=1)
    """A trained sample at least this many versions behind the learner is marked ``stale``."""
    tail_slow_s: float = Field(60.0, gt=0)
    """A sample whose trajectory (issue to training) takes longer is marked ``slow`` (s)."""
    exporter: Literal["file", "otlp-http", "otlp-grpc"] = "file"
    """``file``: OTLP JSON lines under ``dir``, one file per process, read by ``streamrl trace``.
    ``otlp-http`` / ``otlp-grpc``: to a collector at ``endpoint``."""
    dir: str | None = None
    """Folder of the ``file`` exporter; None = ``{run_dir}/traces``."""
    endpoint: str | None = None
    """Collector for the OTLP exporters: ``http://host:4318`` (``/v1/traces`` is appended), or for gRPC
    ``http://host:4317`` (plaintext) / ``https://host:4317`` (TLS; a bare ``host:4317`` is TLS too,
    unless ``OTEL_EXPORTER_OTLP_INSECURE=true``). None = ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
    ``OTEL_EXPORTER_OTLP_ENDPOINT``, else the exporter's default (localhost)."""
    service_name: str | None = None
    """``service.name`` of the spans; None = ``OTEL_SERVICE_NAME``, else ``streamrl-{service}``."""
