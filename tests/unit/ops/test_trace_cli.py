"""The file exporter's OTLP JSON lines read back into ``streamrl trace``'s report, with exact numbers.

A synthetic run: four services (each its own TracerProvider, all writing into one traces folder)
record three prompt groups with chosen durations (ms):

    sample  queue  generate  reward (attempts)    group wait  batch wait  train  staleness  end to end
    g0/0    10     100       40                   150         10          500    0          810
    g0/1    10     200       50                   50          10          500    0          820
    g1/0    30     300       60                   150         10          500    1          1050
    g1/1    30     400       20 failed, then 70   30          10          500    2          1060
    g2/0    50     500       20 failed, 20 failed (dead-lettered: never trained)

plus one weight version (publish 20, loads 30 and 50) and one batch with its step. Percentiles
interpolate linearly, e.g. generation over [100, 200, 300, 400, 500]: p95 = 400 + 0.8 * 100.

Two processes (or a forked child) writing one traces folder:
tests/integration/common/test_trace_file_processes.py.
"""

from __future__ import annotations

import base64
import enum
import json
import math
import sys
from pathlib import Path

import pytest
from google.protobuf.json_format import ParseDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from streamrl.common.telemetry.trace_file import read_spans
from streamrl.common.telemetry.trace_schema import (
    BATCH,
    BATCH_WAIT,
    GENERATE,
    GROUP_WAIT,
    ISSUE,
    QUEUE,
    REWARD,
    STALENESS,
    STEP,
    TRAIN,
    TRAJECTORY_ID,
    WEIGHTS_LOAD,
    WEIGHTS_PUBLISH,
)
from streamrl.common.telemetry.tracing import Tracing, setup_tracing, weights_traceparent
from streamrl.common.telemetry.tracing_config import TracingConfig
from streamrl.ops.cli import main as streamrl_main
from streamrl.ops.trace_cli import main as trace_main
from streamrl.ops.trace_report import END_TO_END, build_report

T0 = 1_000.0


SAMPLES = [
    # group, queue, generate, reward attempts (ms, failed?), group wait, batch wait, staleness (None: not trained)
    ("g0", 10, 100, [(40, False)], 150, 10, 0),
    ("g0", 10, 200, [(50, False)], 50, 10, 0),
    ("g1", 30, 300, [(60, False)], 150, 10, 1),
    ("g1", 30, 400, [(20, True), (70, False)], 30, 10, 2),
    ("g2", 50, 500, [(20, True), (20, True)], None, None, None),
]


TRAIN_MS = 500


def ms(value: float) -> float:
    return value / 1000


def write_run(run_dir: Path) -> None:
    config = TracingConfig(sampling="tail", tail_min_staleness=2)
    tracers: dict[str, Tracing] = {
        name: setup_tracing(config, service=name, instance=f"{name}-0", run_id="r1", run_dir=run_dir)
        for name in ("coordinator", "rollout", "reward", "learner")
    }
    coordinator, rollout, reward, learner = tracers.values()
    issued: dict[str, tuple[str, str]] = {}
    trained: list[str] = []
    for index, (group, queue_ms, gen_ms, attempts, group_ms, batch_ms, staleness) in enumerate(SAMPLES):
        if group not in issued:
            root = coordinator.record(ISSUE, start_s=T0, end_s=T0 + ms(1))
            issued[group] = (root, rollout.record(QUEUE, root, start_s=T0, end_s=T0 + ms(queue_ms)))
        t = T0 + ms(queue_ms)
        generated = rollout.record(
            GENERATE,
            issued[group][1],
            start_s=t,
            end_s=t + ms(gen_ms),
            attributes={TRAJECTORY_ID: f"{group}/{index % 2}"},
        )
        t += ms(gen_ms)
        scored = ""
        for attempt_ms, failed in attempts:
            scored = reward.record(
                REWARD, generated, start_s=t, end_s=t + ms(attempt_ms), error="HttpError: 503" if failed else None
            )
            t += ms(attempt_ms)
        if staleness is None:
            continue
        waited = coordinator.record(GROUP_WAIT, scored, start_s=t, end_s=t + ms(group_ms))
        t += ms(group_ms)
        in_batch = coordinator.record(BATCH_WAIT, waited, start_s=t, end_s=t + ms(batch_ms))
        t += ms(batch_ms)
        with learner.span(TRAIN, in_batch, attributes={STALENESS: staleness}, start_s=t) as span:
            span.mark_keep(staleness=staleness)
            span.end(t + ms(TRAIN_MS))
        trained.append(in_batch)
    batch = coordinator.record(BATCH, start_s=T0, end_s=T0 + ms(1))
    learner.record(STEP, batch, start_s=T0 + 1, end_s=T0 + 1.5, links=trained)
    learner.record(WEIGHTS_PUBLISH, weights_traceparent("r1", 1), start_s=T0 + 2, end_s=T0 + 2 + ms(20))
    for load_ms in (30, 50):
        rollout.record(WEIGHTS_LOAD, weights_traceparent("r1", 1), start_s=T0 + 3, end_s=T0 + 3 + ms(load_ms))
    for tracing in tracers.values():
        tracing.shutdown()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    write_run(tmp_path / "run")
    return tmp_path / "run"


def stages(report: object) -> dict[str, tuple[int, float, float, float]]:
    return {s.stage: (s.count, s.p50_ms, s.p95_ms, s.p99_ms) for s in report.stages}  # type: ignore[attr-defined]


def test_report_numbers_on_a_synthetic_run(run_dir: Path) -> None:
    assert sorted(p.name.split("-")[0] for p in (run_dir / "traces").iterdir()) == [
        "coordinator",
        "learner",
        "reward",
        "rollout",
    ]
    spans, unreadable = read_spans(run_dir)
    assert unreadable == 0
    report = build_report(spans, top=3)
    assert report.num_spans == 35 and report.num_traces == 5
    assert report.num_kept_traces == 2  # g1 (a failed attempt, a stale sample) and g2 (failed)
    assert report.staleness == {0: 2, 1: 1, 2: 1}
    expected = {
        "queue wait": (3, 30.0, 48.0, 49.6),
        "generation": (5, 300.0, 480.0, 496.0),
        "reward": (7, 40.0, 67.0, 69.4),
        "group wait": (4, 100.0, 150.0, 150.0),
        "batch wait": (4, 10.0, 10.0, 10.0),
        "train": (4, 500.0, 500.0, 500.0),
        "weight publish": (1, 20.0, 20.0, 20.0),
        "weight load": (2, 40.0, 49.0, 49.8),
        END_TO_END: (4, 935.0, 1058.5, 1059.7),
    }
    assert list(stages(report)) == list(expected)
    for stage, figures in expected.items():
        assert stages(report)[stage] == pytest.approx(figures, abs=1e-3), stage
    assert (report.num_complete, report.num_incomplete) == (4, 1)
    assert [t.trajectory_id for t in report.slowest] == ["g1/1", "g1/0", "g0/1"]
    slowest = report.slowest[0]
    assert slowest.total_ms == pytest.approx(1060.0, abs=1e-3)
    assert (slowest.staleness, slowest.reward_attempts, slowest.complete) == (2, 2, True)
    assert slowest.stages_ms == pytest.approx(
        {"queue wait": 30, "generation": 400, "reward": 70, "group wait": 30, "batch wait": 10, "train": 500}, abs=1e-3
    )


def test_kept_only_reports_the_marked_traces(run_dir: Path) -> None:
    spans, _ = read_spans(run_dir)
    report = build_report(spans, kept_only=True)
    assert report.staleness == {1: 1, 2: 1}
    assert (report.num_complete, report.num_incomplete) == (2, 1)
    assert [t.trajectory_id for t in report.slowest] == ["g1/1", "g1/0"]


def row(output: str, label: str) -> list[str]:
    (line,) = [x for x in output.splitlines() if x.startswith(f"  {label}  ")]
    return line.split()[-4:]


def test_streamrl_trace_prints_the_breakdown_and_writes_a_plot(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert streamrl_main(["trace", str(run_dir), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "staleness of trained samples (n=4, mean 0.75, max 2)" in out
    assert row(out, "generation") == ["5", "300.0", "480.0", "496.0"]
    assert row(out, "reward") == ["7", "40.0", "67.0", "69.4"]
    assert row(out, "end to end") == ["4", "935.0", "1058.5", "1059.7"]
    assert "trajectories: 4 complete (reached training), 1 incomplete" in out
    assert "1060.0 ms  g1/1  staleness 2  reward attempts 2" in out
    assert "g0/1" not in out  # --top 2
    assert (run_dir / "trace_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_cut_last_line_is_skipped_and_counted(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = next((run_dir / "traces").glob("reward-*.jsonl"))
    with open(victim, "ab") as f:
        f.write(b'{"resourceSpans": [{"resource": {"attri')
    assert trace_main([str(run_dir / "traces"), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "1 unreadable lines skipped" in out
    assert row(out, "reward") == ["7", "40.0", "67.0", "69.4"]
    assert not (run_dir / "traces" / "trace_report.png").exists()


def test_no_trace_files_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert trace_main([str(tmp_path)]) == 2
    assert "no *.jsonl trace files" in capsys.readouterr().err


def _as_protobuf_json(value: object) -> object:
    """OTLP/JSON -> protobuf's JSON mapping: hex ids become base64 (protobuf's encoding of bytes)."""
    if isinstance(value, dict):
        return {
            k: base64.b64encode(bytes.fromhex(v)).decode()
            if k in ("traceId", "spanId", "parentSpanId")
            else _as_protobuf_json(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_as_protobuf_json(v) for v in value]
    return value


def test_every_line_is_an_otlp_export_request(run_dir: Path) -> None:
    lines = [line for f in sorted((run_dir / "traces").glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert lines
    for line in lines:
        data = json.loads(line)
        request = ParseDict(_as_protobuf_json(data), ExportTraceServiceRequest())  # unknown field names fail
        for span in data["resourceSpans"][0]["scopeSpans"][0]["spans"]:
            assert len(span["traceId"]) == 32 and len(span["spanId"]) == 16
            assert isinstance(span["startTimeUnixNano"], str)
        assert request.resource_spans[0].scope_spans[0].scope.name == "streamrl"
    failed = [
        s
        for line in lines
        for s in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
        if s.get("status", {}).get("code") == 2
    ]
    assert len(failed) == 3 and {s["status"]["message"] for s in failed} == {"HttpError: 503"}


def test_without_matplotlib_the_report_is_text_only(
    run_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert trace_main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "no plot: matplotlib is not installed" in out and row(out, "train") == ["4", "500.0", "500.0", "500.0"]
    assert not (run_dir / "trace_report.png").exists()


def test_attribute_values_round_trip_through_the_file(tmp_path: Path) -> None:
    class Transport(enum.IntEnum):
        ZMQ = 3

    values = {
        "s": "x",
        "b": True,
        "i": -7,
        "f": 0.25,
        "nan": float("nan"),
        "inf": float("-inf"),
        "ints": [1, 2],
        "strs": ["a", "b"],
        "enum": Transport.ZMQ,
    }
    tracing = setup_tracing(
        TracingConfig(sampling="all", dir=str(tmp_path)), service="s", instance="i", run_id="r", run_dir="x"
    )
    tracing.record("one", start_s=T0, end_s=T0 + 1, attributes=values)  # type: ignore[arg-type]
    tracing.shutdown()
    (span,), _ = read_spans(tmp_path)
    got = span.attributes
    assert math.isnan(got.pop("nan"))
    assert got == {
        "s": "x",
        "b": True,
        "i": -7,
        "f": 0.25,
        "inf": float("-inf"),
        "ints": [1, 2],
        "strs": ["a", "b"],
        "enum": 3,
    }
