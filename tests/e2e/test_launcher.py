"""``streamrl up``: embedded Redis + the four real services; clean stop on Ctrl-C; loud stop on a failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from streamrl.common.codec import decode
from streamrl.common.messages import Heartbeat
from streamrl.common.streams import StreamNames

pytestmark = pytest.mark.slow
SERVICES = ("coordinator", "rollout", "reward", "learner")
ENV = {
    **os.environ,
    "STREAMRL_REDIS__RETAIN_CONSUMED_S": "86400",
    "STREAMRL_REDIS__PAYLOAD_RETENTION_S": "86400",  # trained and evaluation payloads stay readable
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": "2",
    "TOKENIZERS_PARALLELISM": "false",
}


def start_up(recipe: Path, log: Path) -> subprocess.Popen[bytes]:
    # many steps: the run must still be going when the test stops it
    cmd = [sys.executable, "-m", "streamrl.ops.cli", "up", str(recipe), "--total_steps=1000", "--run_id=up"]
    with log.open("wb") as out:  # the child keeps its own descriptor; ours is closed at once
        return subprocess.Popen(cmd, env=ENV, stdout=out, stderr=subprocess.STDOUT)


def embedded_redis_url(run_dir: Path, log: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if "embedded redis-server at " in line:
                return line.split("embedded redis-server at ")[1].split()[0]
        time.sleep(0.2)
    raise AssertionError(f"no embedded redis in the launcher output:\n{log.read_text()[-3000:]}")


def wait_for_heartbeats(url: str, log: Path, timeout_s: float = 240) -> list[Heartbeat]:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = [
            decode(client.get(k) or b"", Heartbeat)
            for k in client.scan_iter(match=StreamNames("up").heartbeat("*", "*"))
        ]
        running = {b.service for b in beats if b.status == "running"}
        if running >= set(SERVICES):
            return beats
        time.sleep(0.5)
    raise AssertionError(f"not every service heartbeats:\n{log.read_text()[-4000:]}")


def descendants(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def assert_all_gone(procs: list[psutil.Process], timeout_s: float = 10) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()[:4]) for p in alive]}"


def test_up_runs_everything_and_stops_cleanly_on_ctrl_c(tiny_task: Path, tmp_path: Path, write_recipe) -> None:  # type: ignore[no-untyped-def]
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url=None)
    log = tmp_path / "up.log"
    proc = start_up(recipe, log)
    try:
        url = embedded_redis_url(tmp_path / "run", log)
        beats = wait_for_heartbeats(url, log)
        assert {b.service for b in beats} == set(SERVICES)
        children = descendants(proc)
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert "redis-server" in names and all(f"cli {s} " in names for s in SERVICES)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0, log.read_text()[-4000:]
        assert_all_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "stop requested" in text
    for s in SERVICES:
        assert f"{s}/{s}-0 stopped" in text, f"{s} did not shut down cleanly"


def test_up_stops_everything_when_a_child_dies(tiny_task: Path, tmp_path: Path, write_recipe) -> None:  # type: ignore[no-untyped-def]
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url=None)
    log = tmp_path / "up.log"
    proc = start_up(recipe, log)
    try:
        url = embedded_redis_url(tmp_path / "run", log)
        wait_for_heartbeats(url, log)
        children = descendants(proc)
        (reward,) = [p for p in children if "cli reward " in " ".join(p.cmdline())]
        reward.kill()
        assert proc.wait(90) == 1, log.read_text()[-4000:]
        assert_all_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "service reward-0 failed (exit code -9)" in log.read_text()
