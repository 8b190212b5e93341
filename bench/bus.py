"""Bus benchmark: trajectories through publish -> consume -> ack on a real redis-server.

For trajectories of 1k, 8k and 32k tokens (int32 ids + float32 log-probs + uint8 mask, msgpack)
and 1, 2 and 4 consumer processes (each one streamrl ConsumerLoop: decode, de-dup key, commit
script, XACK), it measures:

* throughput: one producer publishes as fast as it can while the consumers drain; messages/s and
  MB/s from the first publish to the last ack;
* latency: a paced producer (a quarter of the measured throughput) stamps each message; the
  consumer records publish -> handled-and-acked time; p50 / p99;
* the raw rate of ``redis-benchmark`` doing XADD of a payload of the same size on the same server.

Usage: python bench/bus.py [--quick]. Prints a table, then one JSON object as the last line, and
writes it to bench/results/bus-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import msgpack
import numpy as np
import redis

from streamrl.common import aio
from streamrl.common.bus import Bus, Output, connect
from streamrl.common.codec import encode
from streamrl.common.config import ConsumerConfig
from streamrl.common.consumer import ConsumerLoop
from streamrl.common.messages import Tensor, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.ops.redis_server import RedisServer

RESULTS = Path(__file__).parent / "results"


def make_trajectory(i: int, num_tokens: int, sent: float = 0.0) -> Trajectory:
    rng = np.random.default_rng(i)
    return Trajectory(
        id=f"g{i}/0",
        group_id=f"g{i}",
        group_index=0,
        group_size=1,
        prompt_ids=Tensor.from_numpy(np.arange(64, dtype=np.int32)),
        response_ids=Tensor.from_numpy(rng.integers(0, 150_000, num_tokens, dtype=np.int32)),
        logprobs=Tensor.from_numpy(rng.standard_normal(num_tokens).astype(np.float32)),
        loss_mask=Tensor.from_numpy(np.ones(num_tokens, dtype=np.uint8)),
        timings={"sent": sent},
    )


def consumer_main(url: str, run_id: str, index: int) -> None:
    aio.run(_consume(url, run_id, index))  # on the services' event loop


async def _consume(url: str, run_id: str, index: int) -> None:
    client = connect(url)
    names = StreamNames(run_id)
    latencies: list[float] = []

    async def handle(msg: Trajectory) -> list[Output]:
        return []

    async def committed(entry_id: str, msg: Trajectory) -> None:  # after outputs + ack are in redis
        sent = msg.timings.get("sent", 0.0)
        if sent:
            latencies.append(time.time() - sent)

    stop = asyncio.Event()
    loop = ConsumerLoop(
        Bus(client),
        names,
        stream=names.trajectories,
        group="bench",
        consumer=f"c{index}",
        handler=handle,
        message_type=Trajectory,
        config=ConsumerConfig(block_ms=50, count=16, max_in_flight=32),
        on_committed=committed,
    )

    async def watch() -> None:
        while not await client.exists(f"bench:{run_id}:done"):
            await asyncio.sleep(0.05)
        stop.set()

    watcher = asyncio.create_task(watch())
    await loop.run(stop)
    watcher.cancel()
    await client.rpush(f"bench:{run_id}:lat", msgpack.packb(latencies))
    await client.aclose()


def _run_consumers(url: str, run_id: str, num_consumers: int) -> list[mp.Process]:
    procs = [mp.Process(target=consumer_main, args=(url, run_id, i)) for i in range(num_consumers)]
    for p in procs:
        p.start()
    return procs


def _wait_drained(client: redis.Redis, run_id: str, total: int, timeout_s: float = 600) -> None:
    stream = StreamNames(run_id).trajectories
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        groups = client.xinfo_groups(stream)
        if groups and groups[0]["entries-read"] == total and groups[0]["pending"] == 0:
            return
        time.sleep(0.002)
    raise TimeoutError("consumers did not drain the stream")


def _finish(client: redis.Redis, run_id: str, procs: list[mp.Process]) -> list[float]:
    client.set(f"bench:{run_id}:done", 1)
    for p in procs:
        p.join(60)
    lat: list[float] = []
    for raw in client.lrange(f"bench:{run_id}:lat", 0, -1):
        lat += msgpack.unpackb(raw)
    return lat


def throughput(url: str, num_tokens: int, num_consumers: int, num_messages: int) -> dict[str, float]:
    run_id = f"tp{num_tokens}x{num_consumers}"
    client = redis.Redis.from_url(url)
    stream = StreamNames(run_id).trajectories
    client.xgroup_create(stream, "bench", id="0", mkstream=True)
    payloads = [encode(make_trajectory(i, num_tokens)) for i in range(num_messages)]
    procs = _run_consumers(url, run_id, num_consumers)
    time.sleep(1.5)  # consumers up
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i, payload in enumerate(payloads):
        pipe.xadd(stream, {b"d": payload}, maxlen=100_000, approximate=True)
        if i % 8 == 7:
            pipe.execute()
    pipe.execute()
    _wait_drained(client, run_id, num_messages)
    elapsed = time.perf_counter() - start
    _finish(client, run_id, procs)
    size = len(payloads[0])
    client.delete(stream)
    return {
        "msgs_per_s": num_messages / elapsed,
        "mb_per_s": num_messages * size / elapsed / 1e6,
        "payload_bytes": size,
    }


def latency(url: str, num_tokens: int, num_consumers: int, rate: float, num_messages: int) -> dict[str, float]:
    run_id = f"lat{num_tokens}x{num_consumers}"
    client = redis.Redis.from_url(url)
    stream = StreamNames(run_id).trajectories
    client.xgroup_create(stream, "bench", id="0", mkstream=True)
    procs = _run_consumers(url, run_id, num_consumers)
    time.sleep(1.5)
    period = 1.0 / rate
    next_t = time.perf_counter()
    template = make_trajectory(0, num_tokens)
    for i in range(num_messages):
        msg = make_trajectory(i, 0)
        msg = Trajectory(
            **{
                **{f: getattr(template, f) for f in template.__struct_fields__},
                "id": msg.id,
                "group_id": msg.group_id,
                "timings": {"sent": time.time()},
            }
        )
        client.xadd(stream, {b"d": encode(msg)}, maxlen=100_000, approximate=True)
        next_t += period
        delay = next_t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    _wait_drained(client, run_id, num_messages)
    lat = np.array(_finish(client, run_id, procs)) * 1e3
    client.delete(stream)
    return {"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)), "rate": rate}


def redis_benchmark_xadd(port: int, payload_bytes: int, num: int) -> float:
    """Raw XADD requests/s of a same-size payload with redis-benchmark (4 connections, no pipelining)."""
    with tempfile.TemporaryDirectory() as tmp:
        blob = "x" * payload_bytes  # the last argument comes from stdin (-x): too long for argv
        cmd = [
            "redis-benchmark",
            "-p",
            str(port),
            "-n",
            str(num),
            "-c",
            "4",
            "-q",
            "-x",
            "XADD",
            "rawbench",
            "MAXLEN",
            "~",
            "1000",
            "*",
            "d",
        ]
        out = subprocess.run(cmd, input=blob, capture_output=True, text=True, cwd=tmp, timeout=600).stdout
    match = re.findall(r"([\d.]+) requests per second", out.replace(",", ""))
    if not match:
        raise RuntimeError(f"could not parse redis-benchmark output: {out[-500:]}")
    return float(match[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer messages (smoke run)")
    parser.add_argument("--sizes", default="1024,8192,32768", help="trajectory lengths (tokens), comma-separated")
    args = parser.parse_args()
    scale = 0.2 if args.quick else 1.0
    base = {1024: 4000, 8192: 1500, 32768: 400}
    counts = {int(t): int(base.get(int(t), 1000) * scale) for t in args.sizes.split(",")}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(tmp, appendonly=False).start()
        try:
            for tokens, n in counts.items():
                size = len(encode(make_trajectory(0, tokens)))
                raw = redis_benchmark_xadd(server.port, size, max(200, n))
                for consumers in (1, 2, 4):
                    tp = throughput(server.url, tokens, consumers, n)
                    lat = latency(
                        server.url,
                        tokens,
                        consumers,
                        rate=max(20.0, tp["msgs_per_s"] / 4),
                        num_messages=max(100, n // 4),
                    )
                    row = {**tp, **lat, "raw_xadd_per_s": raw, "ratio_to_raw": tp["msgs_per_s"] / raw}
                    results[f"{tokens}tok_{consumers}c"] = row
                    print(
                        f"{tokens:>6} tok {consumers} consumers: {tp['msgs_per_s']:8.0f} msg/s {tp['mb_per_s']:7.1f} MB/s"
                        f"  p50 {lat['p50_ms']:.2f} ms p99 {lat['p99_ms']:.2f} ms  raw XADD {raw:8.0f}/s"
                        f"  ratio {row['ratio_to_raw']:.2f}",
                        flush=True,
                    )
        finally:
            server.stop()
    best8k = max((v for k, v in results.items() if k.startswith("8192tok")), key=lambda v: v["ratio_to_raw"])
    summary = {
        "bench": "bus",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {mp.cpu_count()} cpus",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "results": results,
        "target_8k": {
            "ratio_to_raw_ge_0.5": best8k["ratio_to_raw"] >= 0.5,
            "p99_lt_10ms": best8k["p99_ms"] < 10.0,
            "ratio_to_raw": best8k["ratio_to_raw"],
            "p99_ms": best8k["p99_ms"],
        },
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bus-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{platform.node()}.json"
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
