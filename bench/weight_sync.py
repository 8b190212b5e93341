"""Benchmark of one learner -> rollout weight sync over the portable ZMQ path (CPU vLLM or HF).

For each model size it builds two random Qwen2 checkpoints (A and B), starts an engine on A, and
``--repeats`` times publishes B (then A, ...) from a :class:`WeightServer` and applies it with
``engine.update_weights``. Reported per size, median over the repeats:

* ``publish_s``: learner side, torch tensors -> host buckets + checksum;
* ``update_s``: rollout side, pull all buckets + verify + load into the engine + reset the cache;
* ``bytes`` and ``buckets`` on the wire.

Sizes: ``tiny`` (hidden 128, 2 layers, 0.4M parameters) and ``25m`` (hidden 512, 8 layers,
intermediate 1408: 25.9M parameters). Prints a table, then one JSON line, and writes the JSON
under ``bench/results/``. Run with the in-process engine::

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python bench/weight_sync.py [--engine hf] [--wire-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from streamrl.learner.weights import WeightServer
from streamrl.rollout.engine import build_engine
from streamrl.rollout.engine_config import EngineConfig
from streamrl.rollout.tiny_model import build_tiny_qwen2

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "tiny": {"hidden_size": 128, "num_layers": 2},
    "25m": {"hidden_size": 512, "num_layers": 8, "intermediate_size": 1408},
}


def measure(size: str, engine_type: str, wire_dtype: torch.dtype, repeats: int, tmp: Path) -> dict[str, float]:
    dirs = [build_tiny_qwen2(tmp / f"{size}-{s}", seed=s, **SIZES[size]) for s in (0, 1)]  # type: ignore[arg-type]
    states = [
        [(n, t.to(wire_dtype)) for n, t in AutoModelForCausalLM.from_pretrained(d).state_dict().items()] for d in dirs
    ]
    config = EngineConfig(
        type=engine_type, model=str(dirs[0]), dtype="float32", max_model_len=256, kv_cache_gib=0.25, enforce_eager=True
    )  # type: ignore[arg-type]
    engine = build_engine(config)
    server = WeightServer()
    publish_s, update_s = [], []
    try:
        for version in range(1, repeats + 1):
            start = time.perf_counter()
            checksum, num_bytes, num_buckets = server.publish(states[version % 2], version)
            publish_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            asyncio.run(engine.update_weights(server.endpoint, version, checksum, timeout_s=60))
            update_s.append(time.perf_counter() - start)
            assert engine.version == version
    finally:
        engine.close()
        server.close()
    num_params = sum(t.numel() for n, t in states[0] if n != "lm_head.weight")
    return {
        "params": num_params,
        "bytes": num_bytes,
        "buckets": num_buckets,
        "publish_s": statistics.median(publish_s),
        "update_s": statistics.median(update_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--wire-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "25m"])
    args = parser.parse_args()
    wire_dtype = getattr(torch, args.wire_dtype)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            results[size] = measure(size, args.engine, wire_dtype, args.repeats, Path(tmp))
    print(f"{'size':>6} {'params':>12} {'MB':>8} {'buckets':>8} {'publish ms':>11} {'update ms':>10}")
    for size, r in results.items():
        print(
            f"{size:>6} {r['params']:>12,} {r['bytes'] / 1e6:>8.1f} {r['buckets']:>8} "
            f"{r['publish_s'] * 1000:>11.1f} {r['update_s'] * 1000:>10.1f}"
        )
    record = {
        "bench": "weight_sync",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "command": " ".join(sys.argv),
        "engine": args.engine,
        "wire_dtype": args.wire_dtype,
        "results": results,
    }
    out = (
        ROOT
        / "bench"
        / "results"
        / f"weight_sync-{args.engine}-{args.wire_dtype}-{datetime.now(timezone.utc):%Y-%m-%dT%H%M%S}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
