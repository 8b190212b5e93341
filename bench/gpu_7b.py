"""The 7B-shaped LoRA recipe alone on one GPU (issue 37, item 3): ``streamrl up recipes/gpu_7b_lora.toml``
at 256 and at 2,048 new tokens, and once with vLLM asleep between versions.

Each variant is one ``streamrl up`` of the recipe with the variant's overrides, as a subprocess (the
launch and the figures as in ``bench/gpu_vs_trl_7b.py``). Reported per variant:

* ``peak_gpu_gib``: ``nvidia-smi``'s peak for the GPU while the run lasted;
* ``s_per_step_median`` over the steps after ``--warmup-steps``, and generated tokens/s;
* weight sync: the learner's publish (``learner/weights_publish_s``), the engine's update and the
  rollout's message-to-serving time (medians, ms; from the metrics and the services' log lines);
* ``bytes_per_update``: the CUDA IPC buffers the engine opened (``opened a CUDA IPC weight buffer of N
  bytes``: the learner packs one version into them, so their sum is what one update moves; the adapter
  with ``sync = "adapter"``), against ``full_bytes`` (the policy's safetensors) as ``lora_fraction``;
* ``wake_ms`` (the ``sleep`` variant: ``engine awake for policy version N (X ms)``).

Variants: ``256`` (the recipe), ``2048`` (``max_new_tokens`` 2,048, context 2,080), ``sleep`` (256 new
tokens, synchronous: ``max_staleness`` 0, no correction, ``sleep_between_versions``: vLLM's KV cache freed
and weights to host while the learner trains). A 2,048-token step of the recipe's 256 samples generates
and trains ~0.5M tokens: a few steps fit one 10-minute device call, so run variants in separate calls.

    python bench/gpu_7b.py [--variants 256,2048,sleep] [--steps 12] [--timeout-s 420] [--out DIR]
    bash bench/gpu_vs_trl_7b.sh --bench bench/gpu_7b.py --variants 256        (the GPU machine)

Writes ``gpu_7b-<UTC date>.json`` to ``--out``, else ``$OUT``, else ``bench/results``; the last stdout line
is that report. ``--smoke`` runs the 256 variant at CPU size (tiny Qwen2, transformers engine, ZMQ).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_vs_trl_7b as vs

VARIANTS: dict[str, list[str]] = {
    "256": [],
    "2048": ["--coordinator.sampling.max_new_tokens=2048", "--rollout.engine.max_model_len=2080"],
    "sleep": [
        "--coordinator.max_staleness=0",
        "--learner.algo.correction.type=none",
        "--rollout.engine.sleep_between_versions=true",
    ],
}
"""Variant -> overrides of recipes/gpu_7b_lora.toml."""
IPC_BUFFER = re.compile(r"opened a CUDA IPC weight buffer of (\d+) bytes")
WAKE = re.compile(r"engine awake for policy version (\d+) \(([0-9.]+) ms\)")


def log_figures(log: str) -> dict[str, Any]:
    """Bytes one update moves (the sum of the IPC buffers the engine opened: opened once, reused) and the
    engine's wake times, from the run's log (pure)."""
    buffers = [int(n) for n in IPC_BUFFER.findall(log)]
    wakes = [float(ms) for _, ms in WAKE.findall(log)]
    return {
        "bytes_per_update": sum(buffers) or None,
        "ipc_buffers": len(buffers),
        "wake_ms_median": statistics.median(wakes) if wakes else None,
        "wake_ms_max": max(wakes) if wakes else None,
        "wakes": len(wakes),
    }


def safetensors_bytes(model: Path) -> int:
    """Bytes of the policy's weights as saved (every ``*.safetensors`` file of the folder)."""
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


def run_variant(name: str, args: argparse.Namespace, data_dir: Path, work: Path, device: str) -> dict[str, Any]:
    """One ``streamrl up`` of the recipe with the variant's overrides; its figures."""
    model = data_dir / "model"
    run_dir = work / f"streamrl-{name}"
    overrides = [
        *(vs.SMOKE_OVERRIDES if args.smoke else []),
        *VARIANTS[name],
        *args.override,
        f"--total_steps={args.steps}",
        *vs.run_data_overrides(data_dir, model),
        f"--run_dir={run_dir}",
        f"--run_id=gpu-7b-{name}-{int(time.time())}",
    ]
    settings = vs.ours_settings(vs.dry_run_ours(str(vs.RECIPE), overrides, device), args.steps)
    side = vs.run_side(name, vs.our_command(str(vs.RECIPE), overrides), work / f"{name}.log", args.timeout_s, device)
    stats = vs.summarize_ours(side, run_dir, args)
    figures = log_figures(Path(side["log"]).read_text(errors="replace"))
    full = safetensors_bytes(model)
    pipeline = stats.get("pipeline", {})
    return {
        "variant": name,
        "overrides": overrides,
        "settings": settings,
        **{k: v for k, v in stats.items() if k not in ("pipeline",)},
        "weights_publish_ms_median": pipeline.get("weights_publish_s_median_ms"),
        "engine_update_ms_median": pipeline.get("engine_update_median_ms"),
        "rollout_sync_ms_median": pipeline.get("rollout_sync_median_ms"),
        **figures,
        "full_bytes": full,
        "lora_fraction": figures["bytes_per_update"] / full if figures["bytes_per_update"] and full else None,
        "pipeline": pipeline,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--variants", default="256,2048,sleep", help=f"comma-separated, of {sorted(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=None, help="steps per variant (default 12; 6 with --smoke)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--timeout-s", type=float, default=420.0, help="limit per variant")
    parser.add_argument("--smoke", action="store_true", help="the 256 variant at CPU size: checks this script")
    parser.add_argument("--override", action="append", default=[], help="one more recipe override")
    parser.add_argument("--out", default=None, help="report folder (default $OUT, else bench/results)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (6 if args.smoke else 12)
    args.wall_step, args.min_measured = args.steps, 1
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.smoke:
        variants = ["256"]
    if not variants or set(variants) - set(VARIANTS):
        parser.error(f"--variants: of {sorted(VARIANTS)}, got {variants}")
    from gpu import machine_facts

    device = "cpu" if args.smoke else "cuda"
    started = datetime.now(timezone.utc)
    work = vs.ROOT / "runs" / ("gpu_7b_smoke" if args.smoke else "gpu_7b_bench")
    work.mkdir(parents=True, exist_ok=True)
    data_dir = vs.ROOT / "runs" / ("gpu_vs_trl_tiny_data" if args.smoke else "gpu_7b_data")
    prepared = vs.prepare(str(vs.RECIPE), "qwen2_tiny" if args.smoke else "qwen2.5_7b", data_dir, device)
    report: dict[str, Any] = {
        "bench": "gpu_7b_smoke_cpu" if args.smoke else "gpu_7b",
        "note": "CPU smoke of the script (tiny model, no vLLM): not a GPU figure" if args.smoke else None,
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join(["python", "bench/gpu_7b.py", *argv]),
        "machine": machine_facts(),
        "prepared": prepared,
        "variants": {},
    }
    out = Path(args.out or os.environ.get("OUT") or vs.ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu_7b{'_smoke-cpu' if args.smoke else ''}-{started:%Y%m%d-%H%M%S}.json"
    errors = []
    for name in variants:
        result = run_variant(name, args, data_dir, work, device)
        report["variants"][name] = result
        if result["exit_code"] != 0 or result["timed_out"]:
            errors.append(f"{name}: exit code {result['exit_code']}{', timed out' if result['timed_out'] else ''}")
        brief = {k: v for k, v in result.items() if k not in ("overrides", "settings", "pipeline", "step_s")}
        print(f"gpu_7b: {name} {json.dumps(brief)}", flush=True)
        path.write_text(json.dumps(report, indent=2))  # a call cut short keeps the variants done
    report["errors"] = errors
    report["seconds"] = round((datetime.now(timezone.utc) - started).total_seconds(), 1)
    path.write_text(json.dumps(report, indent=2))
    print(f"gpu_7b: report written to {path}", flush=True)
    print(json.dumps(report), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
