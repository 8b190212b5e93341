"""Benchmark: colocated weight sync over CUDA IPC, learner -> engine on one GPU, through the project's path.

Two processes on one GPU. The learner process (spawned) holds a Qwen2-1.5B-shaped set of random
bf16 parameters (28 layers, hidden 1536, intermediate 8960, 12 heads and 2 KV heads of 128, vocab
151,936, q/k/v biases, tied embeddings: 338 parameters, plus ``lm_head.weight`` sent explicitly =
339 tensors, 3.55 GB; shapes built here, nothing downloaded) and publishes each version with
``streamrl.torchkit.weights.ipc.IpcPublisher``: copy into the persistent IPC buffers +
device-side checksum. It sends the ``WeightsPublished`` message as the msgpack bytes the bus would
carry. The engine process (this one) decodes it, fetches with
``streamrl.torchkit.weights.ipc.IpcReceiver`` (copy into staging + checksum verified) and
copies them into its own parameters (339 tensors) the way the transformers engine does: one
``torch._foreach_copy_`` of the received views into the parameters; then it waits for the GPU.

Per update (after ``--warmups`` updates; the first opens the handles), over ``--updates`` updates:

* ``update_ms``: end to end, from the engine asking for a version to its parameters holding it
  (learner publish + message encode/pipe/decode + engine fetch + verify + copy into parameters);
* its parts: ``publish_ms`` (measured in the learner), ``fetch_ms`` and ``load_ms`` (engine);
* ``raw_copy_ms``: one on-device copy of the same number of bytes, in the same run, for scale.

Median and p90 of each; the target is ``update_ms`` median <= 10 ms. The Redis hop of the message
(one XADD/XREAD, well under a millisecond on one host) is not included.

Run (one GPU; the project's packages and their dependencies importable, e.g. msgspec and pyzmq)::

    python bench/gpu_weights.py [--weights-updates 20] [--weights-warmups 3] [--weights-bucket-mb 512]

or as part ``b`` of ``bench/gpu.py`` (``python bench/gpu.py --parts b``).

The last line printed is one JSON object, also written to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for src in ("libs/common/src", "services/learner/src", "services/rollout/src"):
    if str(REPO / src) not in sys.path:
        sys.path.insert(0, str(REPO / src))

import torch  # noqa: E402

from streamrl.common.codec import decode, encode  # noqa: E402
from streamrl.common.messages import WeightsPublished  # noqa: E402
from streamrl.torchkit.weights.ipc import IpcPublisher, IpcReceiver  # noqa: E402

TARGET_MS = 10.0
QWEN2_1_5B = {
    "num_layers": 28,
    "hidden": 1536,
    "intermediate": 8960,
    "num_heads": 12,
    "num_kv_heads": 2,
    "head_dim": 128,
    "vocab": 151_936,
}


def qwen2_shapes(
    num_layers: int, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int, vocab: int
) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of a tied-embedding Qwen2 causal LM (Hugging Face naming, no lm_head)."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (q, hidden)),
            (f"{p}.self_attn.q_proj.bias", (q,)),
            (f"{p}.self_attn.k_proj.weight", (kv, hidden)),
            (f"{p}.self_attn.k_proj.bias", (kv,)),
            (f"{p}.self_attn.v_proj.weight", (kv, hidden)),
            (f"{p}.self_attn.v_proj.bias", (kv,)),
            (f"{p}.self_attn.o_proj.weight", (hidden, q)),
            (f"{p}.mlp.gate_proj.weight", (intermediate, hidden)),
            (f"{p}.mlp.up_proj.weight", (intermediate, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, intermediate)),
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    return shapes


def _learner(conn: Connection, shapes: list[tuple[str, tuple[int, ...]]], bucket_bytes: int) -> None:
    """The learner process: on ``version`` it publishes and sends (message bytes, publish seconds)."""
    torch.manual_seed(0)
    params = [(name, torch.randn(shape, device="cuda", dtype=torch.bfloat16)) for name, shape in shapes]
    marker = dict(params)["model.norm.weight"]
    publisher = IpcPublisher(bucket_bytes=bucket_bytes)
    conn.send("ready")
    while (version := conn.recv()) is not None:
        marker.fill_(float(version % 256))  # every version differs (what the engine checks at the end)
        started = time.perf_counter()
        published = publisher.publish(params, version)
        ipc, checksum = published["ipc"], published["checksum"]
        seconds = time.perf_counter() - started
        message = WeightsPublished(
            version=version,
            step=version,
            batch_id="",
            checksum=checksum,
            num_bytes=publisher.num_bytes,
            num_buckets=publisher.num_buffers,
            endpoint="",
            transport="ipc",
            ipc=ipc,
            published_at=time.time(),
        )
        conn.send_bytes(encode(message))
        conn.send(seconds)


def _stats(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {"median": statistics.median(ms), "p90": statistics.quantiles(ms, n=10)[8], "min": min(ms)}


def _raw_copy_seconds(num_bytes: int, repeats: int) -> list[float]:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    out = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - started)
    return out[1:]


def _measure(
    conn: Connection, names: list[str], sizes: dict[str, tuple[int, ...]], warmups: int, updates: int
) -> tuple[list[list[float]], int, int]:
    """The engine's side: ask for each version, fetch it, load it into the parameters. Returns the
    seconds per measured update ([update, publish, fetch, load]), bytes and buffers."""
    receiver = IpcReceiver(torch.device("cuda", 0))
    params = {
        name: torch.nn.Parameter(torch.empty(sizes[name], device="cuda", dtype=torch.bfloat16), requires_grad=False)
        for name in names
    }
    timings: list[list[float]] = [[], [], [], []]
    for version in range(1, warmups + updates + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        conn.send(version)
        msg = decode(conn.recv_bytes(), WeightsPublished)
        published = time.perf_counter()
        assert msg.ipc is not None
        views = receiver.fetch(msg.ipc, msg.version, msg.checksum)
        received = time.perf_counter()
        with torch.no_grad():  # as HFEngine._load does
            torch._foreach_copy_([params[name].data for name, _ in views], [t for _, t in views], non_blocking=True)
        torch.cuda.synchronize()
        done = time.perf_counter()
        publish_s = conn.recv()
        if version > warmups:
            measured = [done - started, publish_s, received - published, done - received]
            for series, seconds in zip(timings, measured, strict=True):
                series.append(seconds)
    assert torch.equal(params["lm_head.weight"], params["model.embed_tokens.weight"])
    assert bool((params["model.norm.weight"] == float(version % 256)).all()), "the last version did not arrive"
    return timings, msg.num_bytes, msg.num_buckets


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark on GPU 0 (see the module docstring); returns the result record."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench/gpu_weights.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    updates, warmups = args.weights_updates, args.weights_warmups
    if updates < 2 or warmups < 1:
        raise ValueError(f"--weights-updates must be >= 2 and --weights-warmups >= 1, got {updates} and {warmups}")
    layers = args.weights_layers or (2 if args.tiny else QWEN2_1_5B["num_layers"])
    shape = {**QWEN2_1_5B, "num_layers": layers}
    shapes = qwen2_shapes(**shape)
    names = [name for name, _ in shapes] + ["lm_head.weight"]
    sizes = dict(shapes) | {"lm_head.weight": dict(shapes)["model.embed_tokens.weight"]}
    ctx = torch.multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    learner = ctx.Process(target=_learner, args=(child, shapes, args.weights_bucket_mb * 2**20), daemon=True)
    learner.start()
    child.close()  # the learner's end: a dead learner is then an EOFError here, not a hang
    try:
        assert conn.recv() == "ready"
        timings, num_bytes, num_buffers = _measure(conn, names, sizes, warmups, updates)
    finally:
        if learner.is_alive():  # the engine's side is closed by now: no IPC buffer outlives the learner
            conn.send(None)
        learner.join(timeout=60)
    update_s, publish_s, fetch_s, load_s = timings
    raw = _raw_copy_seconds(num_bytes, updates)
    update = _stats(update_s)
    return {
        "bench": "gpu_weights",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "machine": f"{torch.cuda.get_device_name(0)}; {platform.platform()}",
        "torch": torch.__version__,
        "model": {
            "shape": "Qwen2-1.5B" if layers == QWEN2_1_5B["num_layers"] else "Qwen2-1.5B widths",
            **shape,
            "tensors": len(names),
            "bytes": num_bytes,
            "dtype": "bfloat16",
        },
        "bucket_mb": args.weights_bucket_mb,
        "buffers": num_buffers,
        "warmups": warmups,
        "updates": updates,
        "update_ms": update,
        "publish_ms": _stats(publish_s),
        "fetch_ms": _stats(fetch_s),
        "load_ms": _stats(load_s),
        "raw_copy_ms": _stats(raw),
        "target_ms": TARGET_MS,
        "target_met": update["median"] <= TARGET_MS,
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options (``bench/gpu.py`` parses them from the arguments it does not know itself)."""
    parser.add_argument("--weights-updates", type=int, default=20, help="measured updates (>= 2)")
    parser.add_argument("--weights-warmups", type=int, default=3, help="updates first (the first opens the handles)")
    parser.add_argument("--weights-bucket-mb", type=int, default=512, help="size of one IPC buffer (MiB)")
    parser.add_argument(
        "--weights-layers", type=int, default=None, help="decoder layers (default 28 = 1.5B; 2 with --tiny)"
    )
    parser.add_argument("--tiny", action="store_true", help="2 layers (still needs a CUDA GPU): checks this script")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_weights.py needs a CUDA GPU: torch.cuda.is_available() is False here", file=sys.stderr)
        return 2
    record = run(args)
    for key in ("update_ms", "publish_ms", "fetch_ms", "load_ms", "raw_copy_ms"):
        s = record[key]
        print(f"{key:>12}: median {s['median']:7.2f}  p90 {s['p90']:7.2f}  min {s['min']:7.2f}")
    print(
        f"{record['model']['tensors']} tensors, {record['model']['bytes'] / 1e9:.2f} GB in {record['buffers']} buffers"
    )
    out = REPO / "bench" / "results" / f"gpu_weights-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
