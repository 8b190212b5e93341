"""Benchmark of the reward tier: scored trajectories per second through ``RewardService.handle``.

* ``function``: an exact-match Python reward function (run in a worker thread per micro-batch);
* ``http``: the HTTP scorer against a local reward server process (``tests/integration/reward_server.py``,
  the OpenRLHF JSON protocol) with ``max_concurrency`` 1, 8 and 64 requests in flight and
  ``batch_size`` samples per request, first with an instant server, then with a simulated
  model latency per request (``--server-latency-ms``).

Every trajectory is submitted at once, as the consumer loop would with a large ``max_in_flight``;
the micro-batcher groups them. Prints a table, then one JSON object as the last line, and writes
the same JSON (with date, machine and command) under ``bench/results/``.

    python bench/reward.py [--num 2000] [--batch-size 8] [--server-latency-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from streamrl.common.messages import Tensor, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.reward.config import FunctionScorerConfig, HttpScorerConfig, RewardConfig
from streamrl.reward.service import RewardService

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "tests" / "integration" / "reward_server.py"
TOKEN = "bench-token"
REWARD_FUNC = """
def reward_func(queries, prompts, labels, **kwargs):
    rewards = [1.0 if q[len(p):].strip() == l else 0.0 for q, p, l in zip(queries, prompts, labels)]
    return {"rewards": rewards, "scores": rewards}
"""


def trajectories(num: int) -> list[Trajectory]:
    return [
        Trajectory(
            id=f"g{i // 8}/{i % 8}",
            group_id=f"g{i // 8}",
            group_index=i % 8,
            group_size=8,
            prompt_ids=Tensor.from_list([1] * 32, "int32"),
            response_ids=Tensor.from_list([2] * 64, "int32"),
            logprobs=Tensor.from_list([-1.0] * 64, "float32"),
            loss_mask=Tensor.from_list([1] * 64, "uint8"),
            prompt_text=f"What is {i} + {i}? ",
            response_text=str(2 * i if i % 3 else i),
            label=str(2 * i),
        )
        for i in range(num)
    ]


async def measure(config: RewardConfig, batch: list[Trajectory]) -> tuple[float, dict[str, float]]:
    """Trajectories per second through handle(), and the service's metrics."""
    service = RewardService(config, StreamNames("bench"))
    await asyncio.gather(*(service.handle(t) for t in batch[:64]))  # warm up: threads, connections
    start = time.perf_counter()
    outputs = await asyncio.gather(*(service.handle(t) for t in batch))
    elapsed = time.perf_counter() - start
    assert len(outputs) == len(batch)
    metrics = service.metrics()
    await service.close()
    return len(batch) / elapsed, metrics


def start_server(latency_ms: float) -> tuple[subprocess.Popen[str], str]:
    args = ["--always", "slow", "--slow-s", str(latency_ms / 1000)] if latency_ms > 0 else []
    env = {**os.environ, "REWARD_SERVER_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, str(SERVER), *args], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline().split()[-1])
    return proc, f"http://127.0.0.1:{port}/get_reward"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=2000, help="trajectories per measurement")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per HTTP request")
    parser.add_argument(
        "--server-latency-ms",
        type=float,
        default=10.0,
        help="simulated model time per request",
    )
    args = parser.parse_args()
    batch = trajectories(args.num)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        func_path = Path(tmp) / "exact_match.py"
        func_path.write_text(REWARD_FUNC)
        config = RewardConfig(
            scorers=[FunctionScorerConfig(name="exact", path=str(func_path))],
            max_batch_size=64,
        )
        results["function"], _ = asyncio.run(measure(config, batch))
    os.environ["BENCH_RM_TOKEN"] = TOKEN
    for latency_ms in (0.0, args.server_latency_ms):
        proc, url = start_server(latency_ms)
        try:
            for concurrency in (1, 8, 64):
                scorer = HttpScorerConfig(
                    name="remote",
                    urls=[url],
                    batch_size=args.batch_size,
                    max_concurrency=concurrency,
                    token_env="BENCH_RM_TOKEN",
                )
                config = RewardConfig(scorers=[scorer], max_batch_size=512, max_wait_ms=5)
                key = f"http_c{concurrency}_latency{latency_ms:g}ms"
                results[key], metrics = asyncio.run(measure(config, batch))
                assert metrics["reward/http/failures"] == 0 and metrics["reward/http/retries"] == 0
        finally:
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    for name, value in results.items():
        print(f"{name:<28} {value:>10.0f} trajectories/s")
    record = {
        "bench": "reward",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "num_trajectories": args.num,
        "http_batch_size": args.batch_size,
        "trajectories_per_s": {k: round(v, 1) for k, v in results.items()},
    }
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"reward-{record['date'][:19].replace(':', '')}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
