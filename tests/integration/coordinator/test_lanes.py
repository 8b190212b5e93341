"""Lanes on two redis-servers: each lane's coordinator issues only its shard of the dataset, lane 0's also
joins the lanes' batches into the one the learner trains (:mod:`streamrl.coordinator.joining`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from streamrl.common.codec import decode, encode
from streamrl.common.lanes import lane_names
from streamrl.common.messages import PromptWorkItem, WeightsPublished
from streamrl.ops.redis_server import RedisServer


@pytest.fixture
def second_redis(tmp_path: Path) -> Iterator[str]:
    """A second real redis-server: lane 1's."""
    server = RedisServer(tmp_path / "lane1-redis", appendonly=False).start()
    yield server.url
    server.stop()


def start(recipe: Path, run_id: str, lane: int, urls: list[str], *extra: str) -> subprocess.Popen[bytes]:
    """The coordinator of ``lane`` as a process (two lanes at ``urls``); its output goes to ``proc.log_path``."""
    cmd = [
        sys.executable,
        "-m",
        "streamrl.coordinator",
        str(recipe),
        f"--run_id={run_id}",
        "--lanes.count=2",
        f"--lanes.urls={json.dumps(urls)}",
        "--coordinator.eval.dataset=null",
        *extra,
    ]
    log = tempfile.NamedTemporaryFile(prefix=f"coordinator-lane{lane}-", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STREAMRL_LANE": str(lane)}
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name  # type: ignore[attr-defined]
    return proc


def stop(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return Path(proc.log_path).read_text()  # type: ignore[attr-defined]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the coordinator exited ({proc.returncode}) waiting for {what}: {stop(proc)[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def ready(version: int = 0) -> dict[bytes, bytes]:
    event = WeightsPublished(
        version=version, step=version, batch_id="", checksum="0", num_bytes=0, num_buckets=0, endpoint="tcp://x:1"
    )
    return {b"d": encode(event)}


def test_a_lane_coordinator_issues_only_its_shard_of_the_dataset(
    tiny_task: Path, tmp_path: Path, redis_url: str, second_redis: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(40)))
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    lane1 = redis.Redis.from_url(second_redis)
    names = lane_names(run_id, 1)
    lane1.xadd(names.weights, ready())
    proc = start(
        recipe,
        run_id,
        1,
        [redis_url, second_redis],
        f"--coordinator.dataset.path={data}",
        "--coordinator.dataset.shuffle=false",
    )
    try:
        # prompts_per_step 4 over 2 lanes: lane batches of 2 groups; batch 0 and one prefetched = 4 prompts
        wait_for(lambda: lane1.xlen(names.prompts) >= 4, 120, "lane 1's prompts", proc)
        time.sleep(1.0)
        issued = [decode(f[b"d"], PromptWorkItem) for _, f in lane1.xrange(names.prompts)]
        assert [p.prompt_text for p in issued] == ["1+1=", "3+1=", "5+1=", "7+1="]
        assert [p.id for p in issued] == ["p1", "p3", "p5", "p7"]
        assert [p.policy_version for p in issued] == [0, 0, 1, 1]
        assert lane1.get(names.state("cursor")) == b"4"
        assert not redis.Redis.from_url(redis_url).keys(f"*{run_id}/lane1*"), "lane 1 wrote to the home Redis"
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out[-3000:]


def test_a_batch_size_that_does_not_split_over_the_lanes_is_refused_naming_both(
    tiny_task: Path, tmp_path: Path, redis_url: str, second_redis: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    proc = start(recipe, run_id, 0, [redis_url, second_redis], "--coordinator.prompts_per_step=3")
    proc.wait(timeout=60)
    out = stop(proc)
    assert proc.returncode == 2, out[-3000:]
    assert "prompts_per_step = 3" in out and "lanes.count = 2" in out
