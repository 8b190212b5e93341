"""The GPU benchmark of issue 14, on one H200: three parts, each a module with ``run(args) -> dict``.

* ``a`` ``bench/gpu_generate.py``: the transformers engine's generation (0.5B-shaped, bf16, 64 prompts
  x 8 samples x 256 new tokens) next to plain ``model.generate`` (warm) on the same batch;
* ``b`` ``bench/gpu_weights.py``: colocated CUDA IPC weight sync of a 1.5B-shaped bf16 model into the
  engine, through the project's own weight path;
* ``c`` ``bench/gpu_pipeline.py``: ``streamrl up recipes/gpu_qwen2_0.5b.toml`` against TRL's
  GRPOTrainer, per step.

    python bench/gpu.py [--parts a,b,c] [--tiny] [--out DIR] [any part's options, e.g. --pipeline-steps 60]

Each part's module is imported when the part runs; a part that fails is recorded with its traceback
and the others still run. The report (machine, date, exact command, each part's result and time) is
written to ``DIR/gpu-<UTC time>.json`` after every part (so a run cut short keeps what it measured;
DIR = ``--out``, else ``$OUT``, else ``bench/results``) and printed as one JSON object on the last
line. Exit code 1 when a part failed. On the GPU machine run it through ``bench/gpu_device.sh``,
which installs the kit first.

What a part receives (``argparse.Namespace``): this script's ``parts``, ``tiny`` (CPU-size smoke
run) and ``out_dir`` (the report folder: a part may copy a few files there), plus its own options:
a module with ``add_args(parser)`` gets them parsed from the arguments this script does not know
(an argument no part that ran knows is reported under ``ignored_args``). A part that ran but partly
failed lists what went wrong under ``errors`` in its result: it is then reported as failed.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"a": "gpu_generate", "b": "gpu_weights", "c": "gpu_pipeline"}
"""Part -> module in bench/."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--parts", default="a,b,c", help="comma-separated parts to run (a, b, c)")
    parser.add_argument("--tiny", action="store_true", help="CPU-size smoke run of every part")
    parser.add_argument("--out", default=None, help="report folder (default: $OUT, else bench/results)")
    args, rest = parser.parse_known_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown part(s) {unknown}; choose from {sorted(PARTS)}")
    args.parts = parts
    args.rest = rest
    args.out_dir = str(Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results").resolve())
    return args


def machine_facts() -> dict[str, Any]:
    """GPU(s) and driver (nvidia-smi), torch (its version names the CUDA build), transformers,
    DeepSpeed and TRL versions, CPUs, Python, host."""
    facts: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"]
        proc = subprocess.run(query, capture_output=True, text=True, timeout=30)
        facts["gpus"] = [line.strip() for line in proc.stdout.splitlines() if line.strip()] or proc.stderr.strip()
    for package in ("torch", "transformers", "deepspeed", "trl", "accelerate"):
        try:  # versions from the metadata: importing torch here would start CUDA in this process
            facts[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            facts[package] = None
    return facts


def part_args(module: Any, args: argparse.Namespace) -> tuple[argparse.Namespace, set[str]]:
    """The namespace a part runs with: its own options (``add_args``, if it has one) parsed from
    ``args.rest``, then this script's. Also the arguments of ``args.rest`` that the part does not know."""
    if not hasattr(module, "add_args"):
        return args, set(args.rest)
    parser = argparse.ArgumentParser(prog=module.__name__, add_help=False, allow_abbrev=False)
    module.add_args(parser)
    own, unknown = parser.parse_known_args(args.rest)
    return argparse.Namespace(**{**vars(own), **vars(args)}), set(unknown)


def run_part(name: str, args: argparse.Namespace, unknown_to_all: set[str]) -> dict[str, Any]:
    """Import the part's module and run it; a failure becomes ``{"ok": false, "error": traceback}``.
    Removes from ``unknown_to_all`` the arguments this part knows."""
    started = time.perf_counter()
    print(f"gpu: part {name} ({PARTS[name]}) starting", flush=True)
    try:
        module = importlib.import_module(PARTS[name])
        namespace, unknown = part_args(module, args)
        unknown_to_all &= unknown
        outcome = module.run(namespace)
        result: dict[str, Any] = {"ok": not outcome.get("errors"), "result": outcome}
    except (Exception, SystemExit):  # noqa: BLE001 - the boundary of a part: recorded, the other parts still run
        result = {"ok": False, "error": traceback.format_exc()}
        print(f"gpu: part {name} failed:\n{result['error']}", file=sys.stderr, flush=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    release_gpu_memory()
    return result


def release_gpu_memory() -> None:
    """Give back what a part left in this process's CUDA caching allocator (the next part may be
    measured in a subprocess, on the same GPU)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    started = datetime.now(timezone.utc)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu-{started:%Y%m%d-%H%M%S}.json"
    report: dict[str, Any] = {
        "bench": "gpu",
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join(["python", "bench/gpu.py", *argv]),
        "cwd": os.getcwd(),
        "machine": machine_facts(),
        "parts": {},
    }
    unknown_to_all = set(args.rest)
    for name in args.parts:
        report["parts"][name] = run_part(name, args, unknown_to_all)
        path.write_text(json.dumps(report, indent=2))
    if unknown_to_all:
        report["ignored_args"] = sorted(unknown_to_all)
        print(f"gpu: no part knows {sorted(unknown_to_all)}: ignored", file=sys.stderr, flush=True)
    report["seconds"] = round((datetime.now(timezone.utc) - started).total_seconds(), 1)
    path.write_text(json.dumps(report, indent=2))
    print(f"gpu: report written to {path}", flush=True)
    print(json.dumps(report), flush=True)
    return 0 if all(part["ok"] for part in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
