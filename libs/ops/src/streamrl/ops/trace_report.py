"""What a run's traces say: staleness of trained samples, latency per stage, the slowest trajectories.

Pure functions over :class:`streamrl.common.telemetry.trace_file.SpanRecord` lists (no I/O); ``streamrl
trace`` prints and plots the result. A trajectory is one sample's chain (:mod:`streamrl.common.telemetry.trace_schema`):
from the root of its trace through its ``rollout.generate`` span down to its ``learner.train`` span
(complete), or to the last span it reached (incomplete: failed, dropped, still in flight, or its
training not traced). A redelivered step has several attempt spans: the trajectory follows the one
that led on, and counts the reward attempts. Percentiles interpolate linearly between samples
(numpy's default).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from streamrl.common.telemetry.trace_file import SpanRecord
from streamrl.common.telemetry.trace_schema import GENERATE, KEEP, REWARD, STAGES, STALENESS, TRAIN, TRAJECTORY_ID

END_TO_END = "end to end"
"""Label of the whole-trajectory row of the latency table (complete trajectories, root start to train end)."""
_LABEL = {name: label for label, name in STAGES.items()}


@dataclass(frozen=True)
class StageLatency:
    """Latency percentiles of one stage over every span of it (each attempt counts)."""

    stage: str
    count: int
    p50_ms: float
    p95_ms: float
    p99_ms: float


@dataclass(frozen=True)
class TrajectoryTiming:
    """One sample's way through the pipeline."""

    trace_id: str
    trajectory_id: str
    total_ms: float
    """Start of the trace's root to the end of the last span reached."""
    complete: bool
    """Reached a training span."""
    staleness: int | None
    stages_ms: dict[str, float]
    """Stage label -> time spent on the trajectory's path (ms)."""
    reward_attempts: int


@dataclass(frozen=True)
class TraceReport:
    """Everything ``streamrl trace`` prints."""

    num_spans: int
    num_traces: int
    num_kept_traces: int
    """Traces holding a ``streamrl.keep`` mark (tail sampling)."""
    staleness: dict[int, int]
    """Staleness -> trained samples, ascending."""
    stages: list[StageLatency]
    """Pipeline order, stages with spans only, then the end-to-end row."""
    num_complete: int
    num_incomplete: int
    slowest: list[TrajectoryTiming]
    """Complete trajectories, slowest first."""


def latency(stage: str, durations_ms: list[float]) -> StageLatency:
    p50, p95, p99 = np.percentile(np.asarray(durations_ms, dtype=np.float64), [50, 95, 99])
    return StageLatency(stage, len(durations_ms), float(p50), float(p95), float(p99))


def trajectories(spans: list[SpanRecord]) -> list[TrajectoryTiming]:
    """One :class:`TrajectoryTiming` per ``rollout.generate`` span."""
    by_id = {(s.trace_id, s.span_id): s for s in spans}
    children: dict[tuple[str, str], list[SpanRecord]] = defaultdict(list)
    for s in spans:
        if s.parent_id:
            children[(s.trace_id, s.parent_id)].append(s)
    out = []
    for generate in (s for s in spans if s.name == GENERATE):
        up = [generate]
        while up[-1].parent_id and (generate.trace_id, up[-1].parent_id) in by_id:
            up.append(by_id[(generate.trace_id, up[-1].parent_id)])
        below, stack = [], list(children[(generate.trace_id, generate.span_id)])
        while stack:
            s = stack.pop()
            below.append(s)
            stack.extend(children[(s.trace_id, s.span_id)])
        trained = [s for s in below if s.name == TRAIN]
        end = max(trained or below or [generate], key=lambda s: s.end_ns)
        down = [end]
        while down[-1] is not generate:
            down.append(by_id[(generate.trace_id, down[-1].parent_id)])
        path = up[::-1] + down[-2::-1]
        stages: dict[str, float] = {}
        for s in path:
            if s.name in _LABEL:
                stages[_LABEL[s.name]] = stages.get(_LABEL[s.name], 0.0) + s.duration_ms
        staleness = end.attributes.get(STALENESS) if trained else None
        out.append(
            TrajectoryTiming(
                trace_id=generate.trace_id,
                trajectory_id=str(generate.attributes.get(TRAJECTORY_ID, generate.span_id)),
                total_ms=(end.end_ns - path[0].start_ns) / 1e6,
                complete=bool(trained),
                staleness=None if staleness is None else int(staleness),
                stages_ms=stages,
                reward_attempts=sum(s.name == REWARD for s in below),
            )
        )
    return out


def build_report(spans: list[SpanRecord], *, top: int = 10, kept_only: bool = False) -> TraceReport:
    """The report over ``spans`` (only traces holding a keep mark with ``kept_only``)."""
    kept = {s.trace_id for s in spans if KEEP in s.attributes}
    if kept_only:
        spans = [s for s in spans if s.trace_id in kept]
    staleness = Counter(int(s.attributes[STALENESS]) for s in spans if s.name == TRAIN and STALENESS in s.attributes)
    stages = []
    for label, name in STAGES.items():
        durations = [s.duration_ms for s in spans if s.name == name]
        if durations:
            stages.append(latency(label, durations))
    paths = trajectories(spans)
    complete = [t for t in paths if t.complete]
    if complete:
        stages.append(latency(END_TO_END, [t.total_ms for t in complete]))
    return TraceReport(
        num_spans=len(spans),
        num_traces=len({s.trace_id for s in spans}),
        num_kept_traces=len(kept),
        staleness=dict(sorted(staleness.items())),
        stages=stages,
        num_complete=len(complete),
        num_incomplete=len(paths) - len(complete),
        slowest=sorted(complete, key=lambda t: t.total_ms, reverse=True)[:top],
    )


def format_report(report: TraceReport) -> str:
    """The report as text, for a terminal."""
    lines = [f"{report.num_spans} spans in {report.num_traces} traces ({report.num_kept_traces} marked keep)", ""]
    trained = sum(report.staleness.values())
    if trained:
        mean = sum(k * v for k, v in report.staleness.items()) / trained
        lines.append(f"staleness of trained samples (n={trained}, mean {mean:.2f}, max {max(report.staleness)})")
        for value, count in report.staleness.items():
            share = count / trained
            lines.append(f"  {value:>4}  {count:>8}  {100 * share:5.1f}%  {'#' * round(40 * share)}")
    else:
        lines.append("staleness: no traced training spans")
    lines += ["", f"  {'stage':<16}{'n':>8}{'p50 ms':>12}{'p95 ms':>12}{'p99 ms':>12}"]
    for s in report.stages:
        lines.append(f"  {s.stage:<16}{s.count:>8}{s.p50_ms:>12.1f}{s.p95_ms:>12.1f}{s.p99_ms:>12.1f}")
    lines += [
        "",
        f"trajectories: {report.num_complete} complete (reached training), {report.num_incomplete} incomplete",
    ]
    if report.slowest:
        lines.append("slowest complete trajectories:")
    for t in report.slowest:
        parts = " | ".join(f"{label} {ms:.1f}" for label, ms in t.stages_ms.items())
        lines.append(
            f"  {t.total_ms:>10.1f} ms  {t.trajectory_id}  staleness {t.staleness}  reward attempts "
            f"{t.reward_attempts}  trace {t.trace_id}\n      {parts}"
        )
    return "\n".join(lines)
