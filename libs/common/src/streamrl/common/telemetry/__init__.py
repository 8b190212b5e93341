"""Telemetry of every streamrl process: traces and metrics, in one folder.

* :mod:`.tracing`: the tracing API services call (``setup_tracing``, spans, traceparents), over the
  span model of :mod:`.spans`; :mod:`.tracing_sdk` is the OpenTelemetry implementation, imported only
  when tracing is on; :mod:`.tracing_config` its settings; :mod:`.trace_schema` the span names and
  attribute keys; :mod:`.trace_file` the OTLP JSON-lines files under ``{run_dir}/traces/``.
* :mod:`.prom`: the Prometheus ``/metrics`` endpoint of a service; :mod:`.prom_config` its settings.

docs/observability.md describes what is recorded and how to read it. Nothing here imports torch.
"""
