"""The network weight path on one machine's loopback, end to end into a transformers model (CPU).

For a Qwen2-0.5B-shaped and a Qwen2-1.5B-shaped bf16 weight set (random bf16 words, finite; every
parameter of the model once - the tied head is the embedding), this process publishes the set once
(:func:`~streamrl.common.weights.wire.encode_version` into a
:class:`~streamrl.common.weights.wire.BucketServer`) and a receiver process (spawned, not forked)
holding a ``Qwen2ForCausalLM`` built from the config on the CPU in bf16 takes it, ``--repeats`` times
each, interleaved so that they share the machine's load:

* ``stream``: :class:`~streamrl.common.weights.stream.StreamReceiver` (``--connections`` TCP
  connections, each count measured), every verified bucket copied into the model's parameters as it
  arrives (``torch._foreach_copy_``, one copy per tensor, as the transformers engine loads);
* ``engine``: what the transformers engine runs (``streamrl.torchkit.weights.zmq.ZmqReceiver``, the
  transport's receiver: the same stream with its default connections, every bucket verified before the
  engine copies any, then the same copy) - ``engine_gbps``, the figure a user gets;
* ``zmq`` (the path before this one): :func:`~streamrl.common.weights.wire.fetch_buckets`, then the
  same copy into the model;
* ``raw_tcp``: the same bytes (every bucket's data) over one plain TCP socket into a preallocated
  buffer with ``recv_into`` - the ceiling the machine allows, no checksum, no copy into the model.

Time = from the moment the receiver is told the version (the version is already served: "publish
returned") to the receiver's last tensor applied (``time.monotonic`` is one clock for both processes
on Linux); GB/s = model bytes / time (1 GB = 1e9 B). Reported per shape: medians over the repeats,
``vs_raw_tcp`` = loopback / raw of the same run; the top-level ``loopback_gbps`` and ``vs_raw_tcp``
are the lower of the two shapes. After the last stream repeat the receiver's parameters are hashed
and compared with the published set.

    python bench/weights_plane.py [--shapes 0.5b 1.5b] [--repeats 5] [--connections 1 2 4]

``--delta``: delta sync instead, through the same real path (a :class:`BucketServer` keeping
``max_behind`` links, the receiver process's ``ZmqReceiver`` copying every tensor into the model). Each
version after the first moves ``--changed-fraction`` of the bf16 words by one unit in the last place
(default 0.0626: the per-step changed fraction of real GRPO steps at the ``gpu_arithmetic`` lr, 5e-6,
``bench/results/weights_delta-20261207-183232.json``; real steps move some words by more than one ulp, so
their deltas were ~1.3x larger there). Per ``--behind`` k, ``--repeats`` times: the receiver holds version
v, the learner publishes k versions (``publish_encode_s`` + ``publish_serve_s``: encode the version, then
hand it to the server, which waits only for a link still being encoded from the version before), the
receiver asks for the newest at once (``delta_s``: waiting for its link, ``link_encode_s``, then the chain
of k links applied in place and every chunk verified), then takes the same version again whole (``full_s``: what a worker with nothing held pays,
its buffers warm). Reports medians, bytes received each way, and the server's delta memory.

    python bench/weights_plane.py --delta [--shapes 0.5b] [--behind 1 4] [--repeats 3]

Prints a table, then one JSON line last; writes it to ``bench/results/weights_plane-<date>.json`` (or
``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for src in ("libs/common/src", "libs/torchkit/src"):
    if str(ROOT / src) not in sys.path:
        sys.path.insert(0, str(ROOT / src))

import blake3  # noqa: E402
import numpy as np  # noqa: E402

from streamrl.common.weights.chunks import recv_exactly  # noqa: E402
from streamrl.common.weights.stream import StreamReceiver  # noqa: E402
from streamrl.common.weights.wire import BF16, BucketServer, WireTensor, encode_version, fetch_buckets  # noqa: E402

QWEN2 = {"vocab_size": 151_936, "tie_word_embeddings": True, "num_key_value_heads": 2}
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": {
        **QWEN2,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "intermediate_size": 4864,
    },
    "1.5b": {
        **QWEN2,
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "intermediate_size": 8960,
    },
}
TIMEOUT_S = 300.0


def build_model(shape: str) -> Any:
    """A bf16 Qwen2ForCausalLM of ``shape`` on the CPU (storage allocated, not initialised)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape])
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    return model.eval()


def weight_set(shape: str, seed: int = 0) -> list[WireTensor]:
    """Random finite bf16 words for every parameter of the model (names and shapes from a meta model)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape]))
    rng = np.random.default_rng(seed)
    out = []
    for name, p in model.named_parameters():
        words = rng.integers(0, 1 << 16, p.numel(), dtype=np.uint16)
        words &= 0x83FF  # sign + low mantissa bits;
        words |= 0x3800  # exponent of ~1e-3..2e-3: finite, weight-like magnitudes
        out.append(WireTensor(name, BF16, words.reshape(tuple(p.shape))))
    return out


def digest_of(arrays: list[np.ndarray]) -> str:
    h = blake3.blake3()
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


# ----------------------------------------------------------------------------- the receiver process
def receiver_main(conn: Connection, shape: str) -> None:
    import torch

    from streamrl.common.messages import WeightsPublished
    from streamrl.torchkit.weights.zmq import ZmqReceiver

    torch.set_num_threads(1)
    model = build_model(shape)
    params = dict(model.named_parameters())
    receiver = StreamReceiver()  # its staging buffer is the raw baseline's preallocated buffer too
    engine_receiver = ZmqReceiver()

    def apply(tensors: list[Any]) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            srcs = [torch.from_numpy(t.array.view(np.int16)).view(torch.bfloat16) for t in tensors]
        with torch.no_grad():
            torch._foreach_copy_([params[t.name].data for t in tensors], srcs)

    conn.send(("ready", sum(p.numel() * p.element_size() for p in params.values())))
    while True:
        command, *args = conn.recv()
        if command == "stop":
            return
        if command == "stream":
            endpoint, version, checksum, connections = args
            receiver.num_connections = connections
            for bucket in receiver.fetch(endpoint, version, checksum, TIMEOUT_S):
                apply(bucket.tensors)
        elif command == "engine":
            endpoint, version, checksum = args
            event = WeightsPublished(
                version=version,
                step=version,
                batch_id="bench",
                checksum=checksum,
                num_bytes=0,
                num_buckets=0,
                endpoint=endpoint,
            )
            with engine_receiver.receive(event, TIMEOUT_S) as received:
                with torch.no_grad():
                    torch._foreach_copy_(
                        [params[n].data for n, _ in received.tensors], [t for _, t in received.tensors]
                    )
        elif command == "sync_info":
            conn.send(("sync_info", engine_receiver.last_sync._asdict()))
            continue
        elif command == "zmq":
            endpoint, version, checksum = args
            apply(list(fetch_buckets(endpoint, version, checksum, TIMEOUT_S)))
        elif command == "raw":
            port, num_bytes = args
            buffer = receiver.staging(num_bytes)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                conn.send(("connected", 0.0))
                assert recv_exactly(sock, buffer), "raw sender closed early"
        elif command == "digest":
            conn.send(("digest", digest_of([params[name].data.view(torch.int16).numpy() for name in args[0]])))
            continue
        conn.send(("done", time.monotonic()))


# ----------------------------------------------------------------------------- the sender side
def run_raw(conn: Connection, data: list[memoryview], num_bytes: int) -> float:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(("raw", listener.getsockname()[1], num_bytes))
        sock, _ = listener.accept()
        with sock:
            assert conn.recv()[0] == "connected"
            start = time.monotonic()
            for view in data:
                sock.sendall(view)
            tag, end = conn.recv()
    assert tag == "done"
    return float(end - start)


def run_fetch(conn: Connection, command: tuple[Any, ...]) -> float:
    start = time.monotonic()
    conn.send(command)
    tag, end = conn.recv()
    assert tag == "done", tag
    return float(end - start)


def measure(shape: str, repeats: int, connections: list[int], bucket_mb: int) -> dict[str, Any]:
    tensors = weight_set(shape)
    names = [t.name for t in tensors]
    expected = digest_of([t.array for t in tensors])
    encoded = encode_version(tensors, version=1, bucket_bytes=bucket_mb << 20)
    del tensors
    model_bytes = encoded.num_bytes
    data = [memoryview(b.data) for b in encoded.buckets]
    server = BucketServer()
    server.set_current(encoded)
    ctx = get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, shape), daemon=True)
    proc.start()
    try:
        tag, param_bytes = parent.recv()
        assert tag == "ready" and param_bytes == model_bytes, (param_bytes, model_bytes)
        times: dict[str, list[float]] = {"raw_tcp": [], "zmq": [], "engine": []} | {
            f"stream_{c}": [] for c in connections
        }
        for _ in range(repeats + 1):  # the first round warms the buffers and is dropped
            times["raw_tcp"].append(run_raw(parent, data, sum(len(d) for d in data)))
            for c in connections:
                times[f"stream_{c}"].append(run_fetch(parent, ("stream", server.endpoint, 1, encoded.checksum, c)))
            times["engine"].append(run_fetch(parent, ("engine", server.endpoint, 1, encoded.checksum)))
            times["zmq"].append(run_fetch(parent, ("zmq", server.endpoint, 1, encoded.checksum)))
        parent.send(("digest", names))
        tag, actual = parent.recv()
        assert actual == expected, "the receiver's parameters differ from the published set"
        parent.send(("stop",))
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
        server.close()
    gbps = {k: [model_bytes / s / 1e9 for s in v[1:]] for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in gbps.items()}
    best = max(connections, key=lambda c: median[f"stream_{c}"])
    return {
        "model_bytes": model_bytes,
        "num_tensors": len(names),
        "num_buckets": len(encoded.buckets),
        "bucket_bytes": bucket_mb << 20,
        "chunk_bytes": encoded.chunk_bytes,
        "raw_tcp_gbps": median["raw_tcp"],
        "loopback_gbps": median[f"stream_{best}"],
        "connections": best,
        "vs_raw_tcp": median[f"stream_{best}"] / median["raw_tcp"],
        "engine_gbps": median["engine"],
        "engine_vs_raw_tcp": median["engine"] / median["raw_tcp"],
        "old_zmq_gbps": median["zmq"],
        "stream_gbps_by_connections": {c: median[f"stream_{c}"] for c in connections},
        "gbps_per_repeat": gbps,
        "cold_first_round_gbps": {k: model_bytes / v[0] / 1e9 for k, v in times.items()},
        "applied_digest_matches": True,
    }


def next_version(tensors: list[WireTensor], fraction: float, seed: int) -> list[WireTensor]:
    """``tensors`` with ``fraction`` of the words (random positions) moved by one ulp up or down."""
    rng = np.random.default_rng(seed)
    out = []
    for t in tensors:
        words = t.array.copy().reshape(-1)
        where = np.flatnonzero(rng.random(words.size, dtype=np.float32) < fraction)
        words[where] += np.where(rng.random(where.size, dtype=np.float32) < 0.5, 1, -1).astype(np.uint16)
        out.append(WireTensor(t.name, t.dtype, words.reshape(t.array.shape)))
    return out


def measure_delta(shape: str, repeats: int, behinds: list[int], fraction: float, bucket_mb: int) -> dict[str, Any]:
    """Delta against full updates through the real path (module docstring, ``--delta``)."""
    tensors = weight_set(shape)
    server = BucketServer(max_behind=max(behinds))
    ctx = get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, shape), daemon=True)
    proc.start()
    version = 0
    rows: dict[int, dict[str, list[float]]] = {k: {} for k in behinds}

    def publish() -> tuple[float, float, str]:
        nonlocal tensors, version
        version += 1
        tensors = next_version(tensors, fraction, seed=version) if version > 1 else tensors
        start = time.perf_counter()
        encoded = encode_version(tensors, version, bucket_bytes=bucket_mb << 20)
        encoded_at = time.perf_counter()
        server.set_current(encoded)
        return encoded_at - start, time.perf_counter() - encoded_at, encoded.checksum

    def take(checksum: str) -> tuple[float, dict[str, Any]]:
        seconds = run_fetch(parent, ("engine", server.endpoint, version, checksum))
        parent.send(("sync_info",))
        tag, info = parent.recv()
        assert tag == "sync_info"
        return seconds, info

    try:
        tag, _ = parent.recv()
        assert tag == "ready"
        for _ in range(repeats):
            for k in behinds:
                take(publish()[2])  # the receiver holds this version
                row = rows[k]
                for _ in range(k):
                    encode_s, serve_s, checksum = publish()
                    row.setdefault("publish_encode_s", []).append(encode_s)
                    row.setdefault("publish_serve_s", []).append(serve_s)
                seconds, info = take(checksum)  # asked at once: the request waits for the last link
                row.setdefault("link_encode_s", []).append(server.link_seconds)
                row.setdefault("server_delta_bytes", []).append(server.delta_bytes)
                assert info["kind"] == "delta" and info["base_version"] == version - k, info
                row.setdefault("delta_s", []).append(seconds)
                row.setdefault("delta_bytes", []).append(info["num_bytes"])
                seconds, info = take(checksum)  # the same version again: fetched whole
                assert info["kind"] == "full", info
                row.setdefault("full_s", []).append(seconds)
                row.setdefault("full_bytes", []).append(info["num_bytes"])
        parent.send(("digest", [t.name for t in tensors]))
        tag, actual = parent.recv()
        assert actual == digest_of([t.array for t in tensors]), (
            "the receiver's parameters differ from the published set"
        )
        parent.send(("stop",))
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
        server.close()
    out: dict[str, Any] = {"changed_fraction": fraction, "max_behind": max(behinds), "by_behind": {}}
    for k, row in rows.items():
        median = {name: statistics.median(values) for name, values in row.items()}
        median["bytes_ratio"] = median["full_bytes"] / median["delta_bytes"]
        median["speedup"] = median["full_s"] / median["delta_s"]
        out["by_behind"][k] = median
    out["model_bytes"] = rows[behinds[0]]["full_bytes"][0]
    out["applied_digest_matches"] = True
    return out


def main_delta(args: argparse.Namespace) -> None:
    load_before = loadavg()
    results = {
        shape: measure_delta(shape, args.repeats, args.behind, args.changed_fraction, args.bucket_mb)
        for shape in args.shapes
    }
    print(
        f"{'shape':>6} {'k':>3} {'full MB':>8} {'delta MB':>9} {'x fewer':>8} {'full s':>7} {'delta s':>8} {'publish s':>10} {'link s':>6}"
    )
    for shape, r in results.items():
        for k, m in r["by_behind"].items():
            print(
                f"{shape:>6} {k:>3} {m['full_bytes'] / 1e6:>8.1f} {m['delta_bytes'] / 1e6:>9.2f} {m['bytes_ratio']:>8.1f} "
                f"{m['full_s']:>7.3f} {m['delta_s']:>8.3f} {m['publish_encode_s']:>5.2f}+{m['publish_serve_s']:.2f} {m['link_encode_s']:>6.2f}"
            )
    now = datetime.now(timezone.utc)
    out = {
        "bench": "weights_plane_delta",
        **result_header(now, load_before),
        "repeats": args.repeats,
        "shapes": results,
    }
    path = args.out or ROOT / "bench" / "results" / f"weights_plane_delta-{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))


def result_header(now: datetime, load_before: list[float]) -> dict[str, Any]:
    """When, how and where a result file was measured (every variant's file starts with it)."""
    return {
        "date": now.isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "machine": {
            "uname": " ".join(platform.uname()),
            "cores": os.cpu_count(),
            "load_before": load_before,
            "load_after": loadavg(),
        },
    }


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--delta", action="store_true", help="measure delta sync against full updates")
    parser.add_argument("--behind", type=int, nargs="+", default=[1, 4], help="--delta: versions behind")
    parser.add_argument("--changed-fraction", type=float, default=0.0626, help="--delta: bf16 words changed per step")
    args = parser.parse_args()
    if args.delta:
        main_delta(args)
        return
    load_before = loadavg()
    results = {shape: measure(shape, args.repeats, args.connections, args.bucket_mb) for shape in args.shapes}
    print(
        f"{'shape':>6} {'GB':>6} {'raw GB/s':>9} {'stream GB/s':>12} {'conns':>6} {'vs raw':>7} {'engine GB/s':>12} "
        f"{'old zmq GB/s':>13}"
    )
    for shape, r in results.items():
        print(
            f"{shape:>6} {r['model_bytes'] / 1e9:>6.2f} {r['raw_tcp_gbps']:>9.2f} {r['loopback_gbps']:>12.2f} "
            f"{r['connections']:>6} {r['vs_raw_tcp']:>7.2f} {r['engine_gbps']:>12.2f} {r['old_zmq_gbps']:>13.3f}"
        )
    worst = min(results.values(), key=lambda r: r["vs_raw_tcp"])
    now = datetime.now(timezone.utc)
    out = {
        "bench": "weights_plane",
        **result_header(now, load_before),
        "loopback_gbps": min(r["loopback_gbps"] for r in results.values()),
        "raw_tcp_gbps": worst["raw_tcp_gbps"],
        "vs_raw_tcp": worst["vs_raw_tcp"],
        "engine_gbps": min(r["engine_gbps"] for r in results.values()),
        "engine_vs_raw_tcp": min(r["engine_vs_raw_tcp"] for r in results.values()),
        "old_zmq_gbps": min(r["old_zmq_gbps"] for r in results.values()),
        "repeats": args.repeats,
        "shapes": results,
    }
    path = args.out or ROOT / "bench" / "results" / f"weights_plane-{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
