"""Disabled tracing imports no OpenTelemetry module and passes the parent on (in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys


def test_disabled_tracing_imports_nothing_and_passes_the_parent_on() -> None:
    code = """
import sys
from streamrl.common.telemetry.tracing import NULL_TRACING, setup_tracing
from streamrl.common.telemetry.tracing_config import TracingConfig
tracing = setup_tracing(TracingConfig(enabled=False), service="s", instance="i", run_id="r", run_dir="x")
assert tracing is NULL_TRACING
parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
with tracing.span("x", parent, attributes={"a": 1}) as span:
    span.set("b", 2)
    span.mark_keep(failed=True)
assert span.traceparent == parent
assert tracing.record("y", parent, start_s=0.0, end_s=1.0) == parent
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
