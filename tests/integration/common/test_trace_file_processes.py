"""The file exporter in several processes: each writing process (two interpreters, or a forked child) has a
trace file of its own in the shared traces folder, and every span is read back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from streamrl.common.telemetry.trace_file import JsonLinesSpanExporter, read_spans
from streamrl.common.telemetry.tracing import setup_tracing
from streamrl.common.telemetry.tracing_config import TracingConfig

T0 = 1_000.0

WRITER = """
import sys
from streamrl.common.telemetry.tracing import setup_tracing
from streamrl.common.telemetry.tracing_config import TracingConfig
tracing = setup_tracing(TracingConfig(sampling="all", dir=sys.argv[1]), service="rollout", instance="same-name",
                        run_id="r", run_dir="unused")
for i in range(int(sys.argv[2])):
    tracing.record("rollout.generate", start_s=1000.0, end_s=1000.1, attributes={"i": i})
    if i % 100 == 0:
        tracing.flush()
tracing.shutdown()
"""


def test_processes_writing_one_folder_each_have_their_own_file(tmp_path: Path) -> None:
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "500"]) for _ in range(2)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    files = sorted(tmp_path.glob("*.jsonl"))
    assert len(files) == 2 and {f.name for f in files} == {f"rollout-same-name-{w.pid}.jsonl" for w in writers}
    spans, unreadable = read_spans(tmp_path)
    assert unreadable == 0 and len(spans) == 1000
    assert sorted(s.attributes["i"] for s in spans) == sorted(list(range(500)) * 2)


def test_a_forked_child_writes_its_own_file(tmp_path: Path) -> None:
    memory = InMemorySpanExporter()
    tracing = setup_tracing(
        TracingConfig(sampling="all"), service="s", instance="i", run_id="r", run_dir="x", exporter=memory
    )
    tracing.record("one", start_s=T0, end_s=T0 + 1)
    tracing.shutdown()
    spans = memory.get_finished_spans()
    exporter = JsonLinesSpanExporter(tmp_path, "s-i")
    exporter.export(spans)
    pid = os.fork()
    if pid == 0:  # the child: its export must go to a file of its own
        exporter.export(spans)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    exporter.export(spans)
    exporter.shutdown()
    sizes = {f.name: len(f.read_text().splitlines()) for f in tmp_path.glob("*.jsonl")}
    assert sizes == {f"s-i-{os.getpid()}.jsonl": 2, f"s-i-{pid}.jsonl": 1}
