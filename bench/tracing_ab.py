"""Tracing's cost on a whole run: the same ``streamrl up`` run with tracing at its defaults (on,
``ratio`` sampling of 10% of prompt groups, the file exporter) and with ``--tracing.enabled=false``,
alternated (on, off, on, off, ...) so that drift in the machine hits both sides alike.

Each run is bench/gpu_pipeline.py's streamrl side: the recipe (default recipes/gpu_qwen2_0.5b.toml,
its data prepared once), seconds per step over the steady part (start-up, compile and warm-up
excluded the same way for both), and launch-to-finish wall time. Reported: every run, the median
seconds per step of each side and ``overhead = on / off - 1`` (issue 17's target: <= 0.02).

    python bench/tracing_ab.py [--pairs 2] [--pipeline-steps 60] [--tiny]    (--tiny: a 10M model on CPU)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_pipeline

TARGET = 0.02


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gpu_pipeline.add_args(parser)
    parser.add_argument("--pairs", type=int, default=2, help="on/off pairs, alternated (default 2)")
    parser.add_argument("--out-dir", default="bench/results", help="where the result JSON goes")
    args = parser.parse_args()
    spec = gpu_pipeline.spec_from_args(args)
    prepared = gpu_pipeline.prepare(spec)
    runs: list[dict[str, object]] = []
    for pair in range(args.pairs):
        for side in ("on", "off"):
            overrides = spec.overrides if side == "on" else ["--tracing.enabled=false", *spec.overrides]
            work = gpu_pipeline.ROOT / "runs" / "tracing_ab" / f"{pair}-{side}"
            result = gpu_pipeline.run_streamrl(replace(spec, overrides=overrides), work)
            row = {
                "pair": pair,
                "tracing": side,
                "s_per_step": result.get("s_per_step"),
                "wall_s": result.get("wall_s"),
                "steps_done": result.get("steps_done"),
                "exit_code": result.get("exit_code"),
            }
            print("tracing_ab:", json.dumps(row), flush=True)
            runs.append(row)
    per_step = {
        side: [r["s_per_step"] for r in runs if r["tracing"] == side and r["s_per_step"]] for side in ("on", "off")
    }
    medians = {side: statistics.median(v) if v else None for side, v in per_step.items()}
    overhead = medians["on"] / medians["off"] - 1 if medians["on"] and medians["off"] else None  # type: ignore[operator]
    report = {
        "bench": "tracing_ab",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": "python " + " ".join(sys.argv),
        "machine": {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version()},
        "recipe": spec.recipe,
        "steps": spec.steps,
        "prepared": prepared,
        "runs": runs,
        "s_per_step_median": medians,
        "overhead": overhead,
        "target": TARGET,
        "met": overhead is not None and overhead <= TARGET,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tracing_ab-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
