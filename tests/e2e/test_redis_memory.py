"""A real run's Redis memory stays flat and under its bound (every tier real, ``streamrl up`` with its
embedded redis-server).

The streams are sampled while the run goes on: each holds what is in flight, not what the run has
handled so far (a stream that is never trimmed holds one batch, or 16 trajectories, per step), and the
launcher's printed peak ``used_memory`` is under the run's bound (``streamrl.ops.memory_budget``),
with the embedded server's ``maxmemory`` set from it under ``noeviction``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis

from streamrl.common.run_info import read_run_info
from streamrl.common.streams import StreamNames

pytestmark = pytest.mark.slow
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
STEPS = 40


class StreamSampler(threading.Thread):
    """Reads every stream's length of the run (its login found through ``up.json``) every 0.5 s, keeping each
    maximum."""

    def __init__(self, run_dir: Path, run_id: str) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.names = run_dir, StreamNames(run_id)
        self.streams = {
            "prompts": self.names.prompts,
            "trajectories": self.names.trajectories,
            "scored": self.names.scored,
            "batches": self.names.batches,
        }
        self.longest = dict.fromkeys(self.streams, 0)
        self.done = threading.Event()

    def run(self) -> None:
        client = None
        while not self.done.wait(0.5):
            try:
                if client is None:
                    client = redis.Redis.from_url(read_run_info(self.run_dir).url())  # the launcher's login
                for name, key in self.streams.items():
                    self.longest[name] = max(self.longest[name], int(client.xlen(key)))
            except (OSError, ValueError, KeyError, redis.RedisError):
                continue


def test_a_run_holds_its_in_flight_work_not_its_history(
    tiny_task: Path, tmp_path: Path, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp_path / "run"
    recipe = write_recipe(tiny_task, run_dir, None)  # no redis.url: the launcher's embedded redis-server
    sampler = StreamSampler(run_dir, run_id)
    sampler.start()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamrl.ops.cli",
            "up",
            str(recipe),
            f"--run_id={run_id}",
            f"--total_steps={STEPS}",
            "--rollout.engine.type=hf",
            "--coordinator.eval.every_steps=10",
            "--learner.export_every=1000",
            "--up.display=false",
            "--consumer.heartbeat_interval_s=2.0",  # lease TTL 10 s: start-up on a loaded machine keeps its lease
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=560,
    )
    sampler.done.set()
    sampler.join(timeout=5)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    # the recipe: 4 prompts x 4 samples a step, max_staleness 0, prefetch 1, checkpoint_every 2, trimmed
    # every claim_interval_s = 1 s (measured here: at most 34 prompts, 51 trajectories, 4 batches alone; up to
    # 162 trajectories on the 2 cores shared with other test runs, consumed entries waiting for a late trim);
    # never trimmed, the streams would end with 40 batches, 640 trajectories, 240 prompts (5 evaluation rounds).
    # The memory bound below is the contract; these lengths only tell trimmed from never trimmed.
    print(f"longest streams over {STEPS} steps: {sampler.longest}")
    assert sampler.longest["batches"] <= 12, sampler.longest
    assert max(sampler.longest["trajectories"], sampler.longest["scored"]) <= 256, sampler.longest
    assert sampler.longest["prompts"] <= 80, sampler.longest
    limit = re.search(r"redis maxmemory (\d+) MiB, maxmemory-policy noeviction", proc.stdout)
    assert limit is not None, proc.stdout[-3000:]
    peak = re.search(r"redis used_memory peak ([\d.]+) MiB \(this run's bound: ([\d.]+) MiB\)", proc.stdout)
    assert peak is not None, proc.stdout[-3000:]
    print(peak.group(0), limit.group(0))
    assert float(peak.group(1)) <= float(peak.group(2)) <= int(limit.group(1))
    assert "more than this run's memory bound" not in proc.stderr
