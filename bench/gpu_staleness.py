"""Async versus sync: one recipe run at several ``max_staleness`` values, same work, side by side.

    python bench/gpu_staleness.py RECIPE [--staleness 0 1 2] [--steps N] [--target ACC] [--timeout-s S]

Each run is ``streamrl up RECIPE --coordinator.max_staleness=S --total_steps=N`` in a run folder of
its own (``runs/staleness-<recipe>-<S>``, removed first), launched as a user would; nothing else
differs. From each run's ``metrics.jsonl`` and the launch time:

* ``wall_s``: launch to exit (start-up, every step, evaluation, the final save: all of it);
* ``s_per_step``: mean time between consecutive learner steps, the first and the last step left
  out (the first includes start-up and the engine's first batch, the last the final save/export,
  which ``final_step_s`` reports on its own); ``steps_per_s`` is its inverse;
* ``launch_to_target_s`` / ``rl_to_target_s``: launch (or the first learner step) to the first
  held-out evaluation at or above ``--target`` (null when the recipe evaluates nothing or never
  gets there), with the evaluation curve;
* the staleness the learner saw (mean, max) and the samples dropped as too stale.

The ratio ``speedup_vs_sync`` divides the ``max_staleness = 0`` run's ``s_per_step`` by each run's.
Writes ``bench/results/gpu_staleness-<recipe>-<date>.json`` (or ``$OUT/...`` when ``OUT`` is set);
the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(rows: list[dict[str, Any]], launched_at: float, ended_at: float, target: float | None) -> dict[str, Any]:
    """The figures of one run from its metrics rows (see the module docstring)."""
    steps = sorted((r["step"], r["time"]) for r in rows if "learner/step_s" in r)
    if len(steps) < 3:
        raise ValueError(f"only {len(steps)} learner steps in the metrics: nothing to time")
    times = [t for _, t in steps]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    body = gaps[:-1]  # the last gap ends with the final save/export
    mean = statistics.fmean(body)
    evals = sorted((r["step"], r["time"], r["eval/acc"]) for r in rows if "eval/acc" in r)
    reached = next(((s, t) for s, t, acc in evals if target is not None and acc >= target), None)
    learner = [r for r in rows if "learner/staleness_mean" in r]
    return {
        "steps": len(steps),
        "wall_s": round(ended_at - launched_at, 1),
        "first_step_after_launch_s": round(times[0] - launched_at, 1),
        "s_per_step": round(mean, 4),
        "s_per_step_median": round(statistics.median(body), 4),
        "steps_per_s": round(1.0 / mean, 3),
        "final_step_s": round(gaps[-1], 1),
        "target": target,
        "target_step": reached[0] if reached else None,
        "launch_to_target_s": round(reached[1] - launched_at, 1) if reached else None,
        "rl_to_target_s": round(reached[1] - times[0], 1) if reached else None,
        "eval": [[s, acc] for s, _, acc in evals],
        "final_acc": evals[-1][2] if evals else None,
        "staleness_mean": round(statistics.fmean(r["learner/staleness_mean"] for r in learner), 3) if learner else None,
        "staleness_max": max((r["learner/staleness_max"] for r in learner), default=None),
        "samples_too_stale": sum(r.get("coordinator/samples_too_stale", 0) for r in rows),
    }


def run_one(
    recipe: str, staleness: int, steps: int, target: float | None, timeout_s: float, log_dir: Path
) -> dict[str, Any]:
    """Launch the recipe at one ``max_staleness`` and summarize what it wrote."""
    name = f"staleness-{Path(recipe).stem}-{staleness}"
    run_dir = ROOT / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [
        str(Path(sys.executable).parent / "streamrl"),
        "up",
        recipe,
        f"--run_id={name}",
        f"--run_dir={run_dir}",
        f"--total_steps={steps}",
        f"--coordinator.max_staleness={staleness}",
    ]
    log = log_dir / f"{name}.log"
    launched_at = time.time()
    with log.open("w") as out:
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    ended_at = time.time()
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}; last lines of {log}:\n{tail}")
    return {"max_staleness": staleness, "command": " ".join(command[1:]), "log": str(log)} | summarize(
        _rows(run_dir / "metrics.jsonl"), launched_at, ended_at, target
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--target", type=float, default=None, help="held-out accuracy to time (eval/acc)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    args = parser.parse_args()
    if 0 not in args.staleness:
        parser.error("--staleness must include 0: the synchronous run every ratio is taken against")
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    runs = [run_one(args.recipe, s, args.steps, args.target, args.timeout_s, out_dir) for s in args.staleness]
    sync = next(r for r in runs if r["max_staleness"] == 0)
    for r in runs:
        r["speedup_vs_sync"] = round(sync["s_per_step"] / r["s_per_step"], 3)
        r["wall_ratio_vs_sync"] = round(sync["wall_s"] / r["wall_s"], 3)
        print(
            f"max_staleness={r['max_staleness']}: {r['s_per_step']} s/step ({r['speedup_vs_sync']}x sync), "
            f"wall {r['wall_s']} s, final save {r['final_step_s']} s, target at {r['launch_to_target_s']} s "
            f"(step {r['target_step']}), final acc {r['final_acc']}"
        )
    result = {
        "bench": "gpu_staleness",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, Python {platform.python_version()}",
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "recipe": args.recipe,
        "steps": args.steps,
        "runs": runs,
    }
    path = out_dir / f"gpu_staleness-{Path(args.recipe).stem}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"file": str(path)} | {f"s{r['max_staleness']}_speedup": r["speedup_vs_sync"] for r in runs}))


if __name__ == "__main__":
    main()
