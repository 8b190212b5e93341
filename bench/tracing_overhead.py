"""Tracing overhead: what one span costs a service, per sampling case, with the file exporter.

For each case it times N spans the way a handler makes them (start from a traceparent with five
attributes, read the child's traceparent, end), then flushes: wall time per span as the caller
sees it, and process CPU per span including the batch processor's thread (encoding the OTLP JSON
line and writing it). Cases:

* ``off``: tracing disabled (the null object);
* ``sampled``: a recorded span (``sampling = "all"``, or a trace sampled by ``ratio``);
* ``sampled_record``: the same through ``record()`` with explicit times;
* ``unsampled``: the parent's sampled flag is clear (a trace left out by ``ratio``).

From the CPU figures and a sample rate it estimates the share of a 2-core machine tracing takes
under ``all`` and under ``ratio`` at the default ratio: per sample a trajectory has five spans
(generate, reward, group wait, batch wait, train) plus the issue and queue spans of its group.

Usage: python bench/tracing_overhead.py [--num-spans N] [--repeats R] [--samples-per-s S]. Prints a
table, then one JSON object as the last line, and writes it to
bench/results/tracing_overhead-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from streamrl.common.telemetry.trace_schema import (
    ENGINE,
    GENERATE,
    NUM_RESPONSE_TOKENS,
    PARTIAL,
    TRAJECTORY_ID,
    VERSION_START,
)
from streamrl.common.telemetry.tracing import NULL_TRACING, Tracing, setup_tracing
from streamrl.common.telemetry.tracing_config import TracingConfig

RESULTS = Path(__file__).parent / "results"
SAMPLED_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
GROUP_SIZE = 8
SPANS_PER_SAMPLE = 5 + 2 / GROUP_SIZE
"""generate, reward, group wait, batch wait, train per sample; issue and queue once per group."""
NUM_CPUS = 2


def attributes(i: int) -> dict[str, str | int | bool]:
    return {TRAJECTORY_ID: f"p{i}/0", ENGINE: "vllm", VERSION_START: 3, NUM_RESPONSE_TOKENS: 128, PARTIAL: False}


def run_spans(tracing: Tracing, parent: str, n: int) -> str:
    child = ""
    for i in range(n):
        with tracing.span(GENERATE, parent, attributes=attributes(i)) as span:
            child = span.traceparent  # what a handler puts in its output message
    return child


def run_records(tracing: Tracing, parent: str, n: int) -> str:
    now, child = time.time(), ""
    for i in range(n):
        child = tracing.record(GENERATE, parent, start_s=now, end_s=now + 0.1, attributes=attributes(i))
    return child


def measure(case: str, n: int, folder: Path) -> dict[str, float]:
    """Wall and CPU microseconds per span for one case (the flush included)."""
    if case == "off":
        tracing = NULL_TRACING
    else:
        config = TracingConfig(sampling="ratio" if case == "unsampled" else "all", dir=str(folder / case))
        tracing = setup_tracing(config, service="bench", instance="0", run_id="bench", run_dir=folder)
    parent = UNSAMPLED_PARENT if case == "unsampled" else SAMPLED_PARENT
    run = run_records if case == "sampled_record" else run_spans
    run(tracing, parent, min(n, 1000))  # warm-up
    assert tracing.flush()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    run(tracing, parent, n)
    loop_s = time.perf_counter() - wall0
    assert tracing.flush()
    wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    tracing.shutdown()
    return {"caller_us": 1e6 * loop_s / n, "wall_us": 1e6 * wall_s / n, "cpu_us": 1e6 * cpu_s / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-spans", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--samples-per-s",
        type=float,
        default=640.0,
        help="pipeline rate for the estimate (the CPU demo: ~2.5 steps/s of 32 x 8 samples)",
    )
    args = parser.parse_args()
    cases = ("off", "sampled", "sampled_record", "unsampled")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            runs = [measure(case, args.num_spans, Path(tmp) / str(r)) for r in range(args.repeats)]
            results[case] = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
        file_bytes = sum(f.stat().st_size for f in Path(tmp).rglob("*.jsonl"))
        file_spans = args.repeats * (args.num_spans + min(args.num_spans, 1000)) * 2  # sampled, sampled_record
    ratio = TracingConfig().ratio
    spans_per_s = args.samples_per_s * SPANS_PER_SAMPLE
    cpu_all = spans_per_s * results["sampled"]["cpu_us"] / 1e6
    cpu_ratio = (
        spans_per_s * (ratio * results["sampled"]["cpu_us"] + (1 - ratio) * results["unsampled"]["cpu_us"]) / 1e6
    )
    summary = {
        "bench": "tracing_overhead",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "note": "cpu_us counts every thread of the process (the exporter's too); on a shared machine the "
        "wall figures include time other processes took from it, the cpu figures do not",
        "num_spans": args.num_spans,
        "repeats": args.repeats,
        "attributes_per_span": len(attributes(0)),
        "exporter": "file",
        "per_span_us": results,
        "file_bytes_per_span": round(file_bytes / file_spans, 1),
        "estimate": {
            "samples_per_s": args.samples_per_s,
            "spans_per_sample": SPANS_PER_SAMPLE,
            "cpu_share_all": round(cpu_all / NUM_CPUS, 4),
            "default_ratio": ratio,
            "cpu_share_default_ratio": round(cpu_ratio / NUM_CPUS, 4),
        },
    }
    print(f"{'case':<16}{'caller us':>12}{'wall us':>10}{'cpu us':>10}   (per span, median of {args.repeats})")
    for case, r in results.items():
        print(f"{case:<16}{r['caller_us']:>12.2f}{r['wall_us']:>10.2f}{r['cpu_us']:>10.2f}")
    print(f"file: {summary['file_bytes_per_span']} bytes per span")
    print(
        f"at {args.samples_per_s:.0f} samples/s x {SPANS_PER_SAMPLE} spans: {100 * cpu_all / NUM_CPUS:.2f}% of "
        f"{NUM_CPUS} cores with sampling=all, {100 * cpu_ratio / NUM_CPUS:.2f}% with ratio={ratio}"
    )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"tracing_overhead-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{platform.node()}.json"
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
