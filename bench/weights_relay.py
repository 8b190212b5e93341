"""Weights to N receiver processes through the relay (streamrl.common.weights.relay), against a naive star.

    python bench/weights_relay.py [--ns 1,8,32,64] [--size-mb 32] [--chunk-kb 1024] [--fanouts 1,2]
        [--star-ns 8,32] [--repeats 3] [--digest-threads 0] [--ray]

Each row forks N receiver processes (each its own RelayNode and buffer) and one source (this process)
holding ``--size-mb`` of random bytes cut into ``--chunk-kb`` chunks. Topologies: ``chain`` (fanout 1:
every receiver forwards to the next), ``tree<k>`` (k-ary tree) and ``star`` (the source serves every
receiver in full, what the learner's ZMQ path does today). Measured per row:

* ``learner_bytes_per_update_over_model_bytes``: bytes the source process sent / payload bytes;
* ``last_receiver_s``: from the moment the receivers are told to start to the last one holding every
  chunk verified (wall clocks of one host), with the median and the first;
* per topology, least-squares fits over the ``--ns`` past 1 of ``t = a + b*N`` and ``t = a + c*ln N``
  with their RMS residuals.

One host shows the source's bytes (exact: counted at the sender) and the pipelining (time grows by a
per-hop term, not by N x payload), but not a network: every hop is loopback, and all N + 1 processes
share the machine's cores, so the per-hop term here includes the CPU contention of N hashing
receivers. ``--ray`` adds Ray's object store on the same payload (put once, N actors get): on one host
every actor maps the one plasma store, so that row shows zero-copy reads, not a network fan-out.

Prints one line per row, then one JSON line last; writes it to ``bench/results/weights_relay-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from streamrl.common.weights.relay import RelayNode, build_manifest, upstreams

ROOT = Path(__file__).resolve().parents[1]
VERSION = 1


def _receiver(conn: Connection, digest_threads: int) -> None:
    node = RelayNode(stall_s=120.0, digest_threads=digest_threads)
    conn.send(node.address)
    sources, checksum = conn.recv()
    conn.recv()  # go
    cpu = time.process_time()
    node.fetch(VERSION, checksum, sources, deadline_s=300.0)
    conn.send(time.time())
    conn.recv()  # every receiver done: stop serving
    node.close()
    conn.send((node.bytes_sent, time.process_time() - cpu))  # CPU of receiving, verifying and forwarding


def _row(
    topology: str, fanout: int, n: int, data: bytes, chunk_bytes: int, repeats: int, digest_threads: int
) -> dict[str, Any]:
    """The median of ``repeats`` runs by time to the last receiver (this machine is shared: noisy)."""
    runs = sorted(
        (_run(fanout, n, data, chunk_bytes, digest_threads) for _ in range(repeats)), key=lambda r: r["last_receiver_s"]
    )
    row = {"topology": topology, "n": n, **runs[len(runs) // 2]}
    row["last_receiver_s_runs"] = [r["last_receiver_s"] for r in runs]
    print(json.dumps(row), flush=True)
    return row


def _run(fanout: int, n: int, data: bytes, chunk_bytes: int, digest_threads: int) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for _ in range(n):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_receiver, args=(child, digest_threads), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    source = RelayNode(stall_s=120.0)
    manifest = build_manifest(VERSION, data, chunk_bytes)
    source.hold(manifest, data)
    order = [source.address] + [pipe.recv() for pipe in pipes]
    for i, pipe in enumerate(pipes, start=1):
        pipe.send((upstreams(order, i, fanout), manifest.checksum()))
    started = time.time()
    for pipe in pipes:
        pipe.send("go")
    done_at = [pipe.recv() for pipe in pipes]
    for pipe in pipes:
        pipe.send("stop")
    done = [(t, *pipe.recv()) for t, pipe in zip(done_at, pipes, strict=True)]
    for proc in procs:
        proc.join(30)
    source.close()
    times = sorted(t - started for t, _, _ in done)
    return {
        "learner_bytes_per_update_over_model_bytes": round(source.bytes_sent / len(data), 4),
        "last_receiver_s": round(times[-1], 4),
        "median_receiver_s": round(statistics.median(times), 4),
        "first_receiver_s": round(times[0], 4),
        "max_receiver_bytes_sent_over_model_bytes": round(max(sent for _, sent, _ in done) / len(data), 4),
        "receiver_cpu_s_per_gb": round(statistics.median(cpu for _, _, cpu in done) / (len(data) / 1e9), 3),
        "load": os.getloadavg()[0],
    }


def _latency_rows(ns: list[int], repeats: int, digest_threads: int) -> list[dict[str, Any]]:
    """Chain of one 64 KiB chunk: what each hop adds beyond moving bytes (connect, wake, forward)."""
    tiny = os.urandom(64 << 10)
    return [_row("chain_one_64k_chunk", 1, n, tiny, len(tiny), repeats, digest_threads) for n in ns]


def _fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares of last_receiver_s on N and on ln N (one regressor plus intercept each)."""
    pts = [(r["n"], r["last_receiver_s"]) for r in rows if r["n"] > 1]
    out: dict[str, float] = {}
    for name, f in (("linear", float), ("log", math.log)):
        xs, ys = [f(n) for n, _ in pts], [t for _, t in pts]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
        a = my - slope * mx
        rms = math.sqrt(statistics.fmean((a + slope * x - y) ** 2 for x, y in zip(xs, ys, strict=True)))
        key = "b_s_per_receiver" if name == "linear" else "c_s_per_ln_receiver"
        out |= {f"{name}_a_s": round(a, 4), f"{name}_{key}": round(slope, 5), f"{name}_rms_s": round(rms, 4)}
    return out


def _ray(ns: list[int], data: bytes) -> dict[str, Any]:
    import numpy as np
    import ray

    ray.init(num_cpus=2, object_store_memory=2 * len(data) + (256 << 20), include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Getter:
        def get(self, refs: list[Any]) -> float:
            array = ray.get(refs[0])
            int(array[:: 1 << 12].sum())  # touch it
            return time.time()

    out: dict[str, Any] = {}
    payload = np.frombuffer(data, dtype=np.uint8)
    for n in ns:
        actors = [Getter.remote() for _ in range(n)]  # type: ignore[attr-defined]
        ray.get([a.get.remote([ray.put(np.zeros(1, np.uint8))]) for a in actors])  # actors up
        started = time.time()
        ref = ray.put(payload)
        put_s = time.time() - started
        last = max(ray.get([a.get.remote([ref]) for a in actors]))
        out[str(n)] = {
            "put_s": round(put_s, 4),
            "last_receiver_s": round(last - started, 4),
            "load": os.getloadavg()[0],
        }
        print(json.dumps({"topology": "ray_object_store", "n": n, **out[str(n)]}), flush=True)
        for actor in actors:
            ray.kill(actor)
        del ref
    ray.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", default="1,8,32,64")
    parser.add_argument("--size-mb", type=int, default=32)
    parser.add_argument("--chunk-kb", type=int, default=1024)
    parser.add_argument("--fanouts", default="1,2", help="1: chain; k: k-ary tree")
    parser.add_argument("--star-ns", default="8,32")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the median is reported")
    parser.add_argument("--digest-threads", type=int, default=0, help="RelayNode(digest_threads=...) of each receiver")
    parser.add_argument("--ray", action="store_true", help="also Ray's object store, same payload, same ns")
    args = parser.parse_args()
    ns = [int(x) for x in args.ns.split(",")]
    data = os.urandom(args.size_mb << 20)
    chunk_bytes = args.chunk_kb << 10

    started = time.perf_counter()
    build_manifest(VERSION, data, chunk_bytes)
    digest_s_per_gb = (time.perf_counter() - started) / (len(data) / 1e9)

    rows: list[dict[str, Any]] = []
    topologies = [("chain" if k == 1 else f"tree{k}", k, ns) for k in map(int, args.fanouts.split(","))]
    topologies.append(("star", 1 << 30, [int(x) for x in args.star_ns.split(",")]))
    for topology, fanout, row_ns in topologies:
        for n in row_ns:
            rows.append(_row(topology, fanout, n, data, chunk_bytes, args.repeats, args.digest_threads))
    rows += _latency_rows(ns, args.repeats, args.digest_threads)
    topologies.append(("chain_one_64k_chunk", 1, ns))
    fits = {t: _fit([r for r in rows if r["topology"] == t]) for t, _, row_ns in topologies if len(row_ns) > 2}

    now = datetime.now(timezone.utc)
    result = {
        "date": now.isoformat(timespec="seconds"),
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
        "load": os.getloadavg(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "payload_mb": args.size_mb,
        "chunk_kb": args.chunk_kb,
        "digest_threads": args.digest_threads,
        "num_chunks": math.ceil(len(data) / chunk_bytes),
        "digest_s_per_gb": round(digest_s_per_gb, 4),
        "rows": rows,
        "fits": fits,
        "ray_object_store": _ray(ns, data) if args.ray else None,
    }
    out = ROOT / "bench" / "results" / f"weights_relay-{now.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
