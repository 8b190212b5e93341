"""``streamrl trace RUN_DIR``: read a run's trace files, print the report, write a plot.

    streamrl trace runs/demo                 # report + runs/demo/trace_report.png
    streamrl trace runs/demo --kept          # only traces marked under tail sampling
    streamrl trace runs/demo/traces --top 20 --no-plot

Reads the OTLP JSON lines the ``file`` exporter writes (:mod:`streamrl.common.telemetry.trace_file`); the
analysis is :mod:`streamrl.ops.trace_report`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from streamrl.common.telemetry.trace_file import read_spans, trace_files
from streamrl.ops.trace_report import TraceReport, build_report, format_report


def write_plot(report: TraceReport, path: Path) -> None:
    """Three panels: staleness histogram, p50/p95/p99 per stage, where the slowest trajectories spent their time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_stale, ax_stage, ax_slow) = plt.subplots(1, 3, figsize=(18, 5))
    ax_stale.bar([str(k) for k in report.staleness], list(report.staleness.values()), color="tab:blue")
    ax_stale.set(title="staleness of trained samples", xlabel="learner version - behaviour version", ylabel="samples")
    labels = [s.stage for s in report.stages]
    for offset, (name, values) in zip(
        (-0.27, 0.0, 0.27),
        (
            ("p50", [s.p50_ms for s in report.stages]),
            ("p95", [s.p95_ms for s in report.stages]),
            ("p99", [s.p99_ms for s in report.stages]),
        ),
        strict=True,
    ):
        ax_stage.barh([i + offset for i in range(len(labels))], values, height=0.27, label=name)
    ax_stage.set_yticks(range(len(labels)), labels)
    ax_stage.invert_yaxis()
    ax_stage.set(title="latency per stage", xlabel="ms")
    if any(s.p99_ms > 0 for s in report.stages):
        ax_stage.set_xscale("log")
    ax_stage.legend()
    slow = report.slowest
    left = [0.0] * len(slow)
    for label in dict.fromkeys(label for t in slow for label in t.stages_ms):
        widths = [t.stages_ms.get(label, 0.0) for t in slow]
        ax_slow.barh(range(len(slow)), widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax_slow.set_yticks(range(len(slow)), [t.trajectory_id for t in slow])
    ax_slow.invert_yaxis()
    ax_slow.set(title="slowest trajectories", xlabel="ms (stages on the path; gaps not shown)")
    if slow:
        ax_slow.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamrl trace", description="Report on a run's traces.")
    parser.add_argument("run_dir", type=Path, help="run folder (with traces/) or a folder of *.jsonl trace files")
    parser.add_argument("--top", type=int, default=10, help="slowest trajectories to list (default 10)")
    parser.add_argument("--kept", action="store_true", help="only traces marked streamrl.keep (tail sampling)")
    parser.add_argument("--plot", type=Path, default=None, help="plot file (default RUN_DIR/trace_report.png)")
    parser.add_argument("--no-plot", action="store_true", help="write no plot")
    args = parser.parse_args(argv)
    files = trace_files(args.run_dir)
    if not files:
        print(f"streamrl trace: no *.jsonl trace files in {args.run_dir} or {args.run_dir / 'traces'}", file=sys.stderr)
        return 2
    spans, unreadable = read_spans(args.run_dir)
    report = build_report(spans, top=args.top, kept_only=args.kept)
    print(f"{len(files)} trace files" + (f", {unreadable} unreadable lines skipped" if unreadable else ""))
    print(format_report(report))
    if args.no_plot:
        return 0
    plot = args.plot or (args.run_dir / "trace_report.png")
    try:
        write_plot(report, plot)
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        print("no plot: matplotlib is not installed (pip install 'streamrl-ops[plot]')")
        return 0
    print(f"plot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
