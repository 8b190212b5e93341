"""Benchmarks of the learner -> rollout weight sync: the portable ZMQ path, and the broadcast group.

``--mode zmq`` (default; CPU vLLM or HF): for each model size it builds two random Qwen2
checkpoints (A and B), starts an engine on A, and ``--repeats`` times publishes B (then A, ...)
from a :class:`ZmqPublisher` and applies it with ``engine.update_weights``. Reported per size,
median over the repeats:

* ``publish_s``: learner side, torch tensors -> host buckets + checksum;
* ``update_s``: rollout side, pull all buckets + verify + load into the engine + reset the cache;
* ``bytes`` and ``buckets`` on the wire.

Sizes: ``tiny`` (hidden 128, 2 layers, 0.4M parameters) and ``25m`` (hidden 512, 8 layers,
intermediate 1408: 25.9M parameters). Run with the in-process engine::

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python bench/weight_sync.py [--engine hf] [--wire-dtype bfloat16]

``--mode broadcast`` times the path of ``learner.weights_transport = "broadcast"`` on one machine,
for a Qwen2-1.5B-shaped bf16 model (hidden 1536, 28 layers, 12 heads and 2 KV heads of 128,
intermediate 8960, vocab 151,936, tied embeddings; random weights saved to a temporary folder) or,
with ``--tiny``, a 2-layer model of the same family that runs on a CPU. Median and p90 (ms) of:

* ``gather``: a single-rank DeepSpeed ZeRO-3 engine (``streamrl.learner.engine.ModelEngine``, frozen)
  yields every full parameter (``iter_full_params``: ``GatheredParameters`` per 512 MiB group, a
  clone each) into a list;
* ``pack``: ``BroadcastPublisher.publish`` of that list: copy into the flat buckets + the
  device-side block checksum - all the training step waits for;
* ``checksum``: the checksum alone, over buffers of the buckets' sizes;
* ``publish``: the learner's path, ``publish(engine.iter_full_params())`` (gather streamed into the buckets);
* the broadcast, as far as the machine allows:
  - ``--receivers N`` (default: 1 on CPU; on CUDA 1 when a second GPU is visible, else 0): N
    processes, each a ``BroadcastMember`` on cuda:1..N (NCCL) or on the CPU (gloo), join the
    group; ``broadcast`` = publish returned -> every receiver acknowledged (store handshakes,
    buckets, checksum on the receivers) and ``buckets`` = the publisher's broadcast calls alone;
  - on CUDA, ``nccl_self``: the broadcast calls of every bucket on a 1-member NCCL group - all
    one GPU allows (NCCL takes one rank per GPU): call and launch cost, no transfer.

    python bench/weight_sync.py --mode broadcast [--tiny] [--device cpu|cuda] [--receivers N] [--bucket-mb 512]

Both modes print a table, then one JSON line last, and write the JSON to ``bench/results/`` (or to
``--out``, else ``$OUT``, when set).
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
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for src in ("libs/common/src", "services/learner/src", "services/rollout/src"):  # the GPU machine runs from the tree
    if str(ROOT / src) not in sys.path:
        sys.path.insert(0, str(ROOT / src))

import torch  # noqa: E402

SIZES = {
    "tiny": {"hidden_size": 128, "num_layers": 2},
    "25m": {"hidden_size": 512, "num_layers": 8, "intermediate_size": 1408},
}
QWEN2_1_5B = {
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151_936,
}
TINY = {
    **QWEN2_1_5B,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 256,
    "vocab_size": 2048,
}


# ----------------------------------------------------------------------------- zmq mode
def measure_zmq(size: str, engine_type: str, wire_dtype: torch.dtype, repeats: int, tmp: Path) -> dict[str, float]:
    import asyncio

    from transformers import AutoModelForCausalLM

    from streamrl.rollout.engines.config import EngineConfig
    from streamrl.rollout.engines.factory import build_engine
    from streamrl.torchkit.testing import build_tiny_qwen2, weights_event
    from streamrl.torchkit.weights.zmq import ZmqPublisher

    dirs = [build_tiny_qwen2(tmp / f"{size}-{s}", seed=s, **SIZES[size]) for s in (0, 1)]  # type: ignore[arg-type]
    states = [
        [(n, t.to(wire_dtype)) for n, t in AutoModelForCausalLM.from_pretrained(d).state_dict().items()] for d in dirs
    ]
    config = EngineConfig(
        type=engine_type, model=str(dirs[0]), dtype="float32", max_model_len=256, kv_cache_gib=0.25, enforce_eager=True
    )  # type: ignore[arg-type]
    engine = build_engine(config)
    server = ZmqPublisher()
    publish_s, update_s = [], []
    try:
        for version in range(1, repeats + 1):
            start = time.perf_counter()
            published = server.publish(states[version % 2], version)
            checksum, num_bytes, num_buckets = published["checksum"], published["num_bytes"], published["num_buckets"]
            publish_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            asyncio.run(engine.update_weights(weights_event(version, endpoint=server.endpoint, checksum=checksum), 60))
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


def run_zmq(args: argparse.Namespace) -> dict[str, Any]:
    wire_dtype = getattr(torch, args.wire_dtype)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            results[size] = measure_zmq(size, args.engine, wire_dtype, args.repeats, Path(tmp))
    print(f"{'size':>6} {'params':>12} {'MB':>8} {'buckets':>8} {'publish ms':>11} {'update ms':>10}")
    for size, r in results.items():
        print(
            f"{size:>6} {r['params']:>12,} {r['bytes'] / 1e6:>8.1f} {r['buckets']:>8} "
            f"{r['publish_s'] * 1000:>11.1f} {r['update_s'] * 1000:>10.1f}"
        )
    return {"bench": "weight_sync", "engine": args.engine, "wire_dtype": args.wire_dtype, "results": results}


# ----------------------------------------------------------------------------- broadcast mode
def _stats(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    p90 = statistics.quantiles(ms, n=10)[8] if len(ms) > 1 else ms[0]
    return {"median": statistics.median(ms), "p90": p90, "min": min(ms)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _save_model(folder: Path, shape: dict[str, int], device: torch.device) -> int:
    """A random bf16 Qwen2 of ``shape`` (tied embeddings) and a small tokenizer in ``folder``; returns its parameters."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from streamrl.torchkit.testing import build_tokenizer

    config = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=4096)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    build_tokenizer(folder)  # the engine loads one; its vocabulary does not matter here
    del model
    return num_params


def _receiver(conn: Connection, rendezvous: bytes, device: str) -> None:
    """A rollout worker's member of the group on ``device``; it stages every version until told to stop."""
    from streamrl.common.weights.broadcast import decode_rendezvous
    from streamrl.torchkit.weights.broadcast_member import BroadcastMember

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    receiver = BroadcastMember(decode_rendezvous(rendezvous), torch.device(device), "bench", timeout_s=120)
    conn.recv()
    receiver.close()


def _self_broadcast_seconds(sizes: list[int], device: torch.device, repeats: int) -> list[float]:
    """Broadcast calls of buckets of ``sizes`` on a 1-member NCCL group (see the module docstring)."""
    import torch.distributed as dist

    from streamrl.torchkit.weights.broadcast import new_group

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = new_group(dist.PrefixStore("self/", store), 0, 1, "nccl", 60.0, device)
    buckets = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    options = dist.BroadcastOptions()
    options.rootRank = 0
    out = []
    for _ in range(repeats + 1):
        _sync(device)
        started = time.perf_counter()
        for bucket in buckets:
            group.broadcast([bucket], options).wait()
        _sync(device)
        out.append(time.perf_counter() - started)
    group.abort()
    return out[1:]


def _start_receivers(rendezvous: bytes, count: int, device: torch.device) -> list[tuple[Connection, Any]]:
    ctx = torch.multiprocessing.get_context("spawn")
    procs = []
    for index in range(count):
        conn, child = ctx.Pipe()
        where = "cpu" if device.type == "cpu" else f"cuda:{index + 1}"
        proc = ctx.Process(target=_receiver, args=(child, rendezvous, where), daemon=True)
        proc.start()
        procs.append((conn, proc))
    return procs


def _round(engine: Any, publisher: Any, version: int, device: torch.device, receivers: int) -> dict[str, float]:
    """One measurement of every part (versions ``version`` and ``version + 1``); seconds by part."""
    from streamrl.torchkit.weights.ipc import weights_checksum

    _sync(device)
    started = time.perf_counter()
    params = list(engine.iter_full_params())
    _sync(device)
    gathered = time.perf_counter()
    published = publisher.publish(params, version)  # the checksum's result waits for the device
    info = published["broadcast"]
    packed = time.perf_counter()
    del params
    out = {"gather": gathered - started, "pack": packed - gathered}
    if receivers:
        publisher.wait_delivered(version, timeout_s=300, min_members=receivers)
        out.update(broadcast=time.perf_counter() - packed, buckets=publisher.last_delivery["buckets_s"])
    buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in info.bucket_bytes]
    _sync(device)
    started = time.perf_counter()
    weights_checksum(buffers, version)
    out["checksum"] = time.perf_counter() - started
    del buffers
    started = time.perf_counter()
    publisher.publish(engine.iter_full_params(), version + 1)
    out["publish"] = time.perf_counter() - started
    if receivers:
        publisher.wait_delivered(version + 1, timeout_s=300, min_members=receivers)
    return out


def _pick_device(args: argparse.Namespace) -> tuple[torch.device, int]:
    """The device of the learner's buckets and the number of receivers (see the module docstring)."""
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    receivers = args.receivers
    if receivers is None:
        receivers = 1 if device.type == "cpu" else min(1, torch.cuda.device_count() - 1)
    if device.type == "cuda" and receivers > torch.cuda.device_count() - 1:
        raise ValueError(f"--receivers {receivers} needs {receivers + 1} GPUs (NCCL: one rank per GPU)")
    return device, receivers


def run_broadcast(args: argparse.Namespace) -> dict[str, Any]:
    from streamrl.common.weights.broadcast import encode
    from streamrl.learner.ds_config import DeepSpeedConfig
    from streamrl.learner.engine import ModelEngine
    from streamrl.torchkit.weights.broadcast import BroadcastPublisher

    device, receivers = _pick_device(args)
    shape = TINY if args.tiny else QWEN2_1_5B
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        num_params = _save_model(Path(tmp), shape, device)
        print(f"model of {num_params:,} parameters saved in {time.perf_counter() - started:.1f} s", flush=True)
        ds = DeepSpeedConfig(zero_stage=3, dtype="bf16", scheduler="constant", attn_implementation="sdpa")
        engine = ModelEngine.from_config(tmp, ds, train=False)
    publisher = BroadcastPublisher(bucket_bytes=args.bucket_mb * 2**20, timeout_s=120)
    procs: list[tuple[Connection, Any]] = []
    timings: dict[str, list[float]] = {}
    try:
        published = publisher.publish(engine.iter_full_params(), 1)
        info = published["broadcast"]
        if receivers:  # they join, and get version 1, before the first round
            procs = _start_receivers(encode(info), receivers, device)
            publisher.wait_delivered(1, timeout_s=300, min_members=receivers)
        for repeat in range(args.warmups + args.repeats):
            measured = _round(engine, publisher, 2 * repeat + 2, device, receivers)
            for part, seconds in measured.items():
                if repeat >= args.warmups:
                    timings.setdefault(part, []).append(seconds)
        if device.type == "cuda":
            timings["nccl_self"] = _self_broadcast_seconds(info.bucket_bytes, device, args.repeats)
    finally:
        for conn, _ in procs:
            conn.send("stop")
        for _, proc in procs:
            proc.join(timeout=60)
        publisher.close()
    results = {part: _stats(seconds) for part, seconds in timings.items()}
    print(f"{'ms':>10} {'median':>9} {'p90':>9} {'min':>9}")
    for name, r in results.items():
        print(f"{name:>10} {r['median']:>9.2f} {r['p90']:>9.2f} {r['min']:>9.2f}")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "bench": "weight_sync_broadcast",
        "device": str(device),
        "gpu": gpu,
        "tiny": args.tiny,
        "model": {**shape, "params": num_params, "dtype": "bfloat16", "tied_embeddings": True},
        "bytes": publisher.num_bytes,
        "buckets": publisher.num_buckets,
        "bucket_mb": args.bucket_mb,
        "backend": info.backend,
        "receivers": receivers,
        "repeats": args.repeats,
        "results_ms": results,
        "measured": {
            "gather": "single-rank DeepSpeed ZeRO-3 (frozen) iter_full_params into a list",
            "pack": "publish(list): copy into the flat buckets + device block checksum",
            "checksum": "device block checksum alone over buffers of the buckets' sizes",
            "publish": "publish(engine.iter_full_params()): gather streamed into the buckets + checksum",
            "broadcast": "publish returned -> every receiver acknowledged (store handshakes, buckets, receiver checksum)",
            "buckets": "the publisher thread's broadcast calls of every bucket",
            "nccl_self": "broadcast calls of every bucket on a 1-member NCCL group (no transfer)",
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["zmq", "broadcast"], default="zmq")
    parser.add_argument("--out", default=None, help="result folder (default: $OUT, else bench/results)")
    parser.add_argument("--repeats", type=int, default=5)
    zmq = parser.add_argument_group("zmq mode")
    zmq.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    zmq.add_argument("--wire-dtype", choices=["float32", "bfloat16"], default="float32")
    zmq.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "25m"])
    broadcast = parser.add_argument_group("broadcast mode")
    broadcast.add_argument("--tiny", action="store_true", help="a 2-layer model instead of the 1.5B shape (CPU)")
    broadcast.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    broadcast.add_argument("--receivers", type=int, default=None, help="receiver processes (see the docstring)")
    broadcast.add_argument("--bucket-mb", type=int, default=512)
    broadcast.add_argument("--warmups", type=int, default=1)
    args = parser.parse_args()
    if args.repeats < 1 or args.warmups < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmups >= 0, got {args.repeats} and {args.warmups}")
    now = datetime.now(timezone.utc)
    record = run_broadcast(args) if args.mode == "broadcast" else run_zmq(args)
    record = {
        **record,
        "date": now.isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "command": " ".join(sys.argv),
    }
    name = (
        f"weight_sync-broadcast-{record['device'].replace(':', '')}{'-tiny' if args.tiny else ''}"
        if args.mode == "broadcast"
        else f"weight_sync-{args.engine}-{args.wire_dtype}"
    )
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results") / f"{name}-{now:%Y-%m-%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
