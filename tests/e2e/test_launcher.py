"""``streamrl up``: embedded Redis (closed: each service its own login) + the four real services; clean stop on
Ctrl-C; a killed service restarted (the crash-loop limit: tests/integration/ops/test_launcher_up_defaults.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import redis

from streamrl.common.health import live_heartbeats
from streamrl.common.messages import Heartbeat
from streamrl.common.run_info import UP_FILE, read_run_info
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


def start_up(recipe: Path, log: Path, total_steps: int = 1000) -> subprocess.Popen[bytes]:
    # many steps by default: the run must still be going when the test stops it
    cmd = [sys.executable, "-m", "streamrl.ops.cli", "up", str(recipe), f"--total_steps={total_steps}", "--run_id=up"]
    with log.open("wb") as out:  # the child keeps its own descriptor; ours is closed at once
        return subprocess.Popen(cmd, env=ENV, stdout=out, stderr=subprocess.STDOUT)


def embedded_redis_url(run_dir: Path, log: Path, timeout_s: float = 60) -> str:
    """The launcher's login to its embedded Redis (``streamrl scale``'s way in: up.json names its file)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run_dir / UP_FILE).exists():
            return read_run_info(run_dir).url()
        time.sleep(0.2)
    raise AssertionError(f"no embedded redis in the launcher output:\n{log.read_text()[-3000:]}")


def wait_for_heartbeats(url: str, log: Path, timeout_s: float = 240) -> list[Heartbeat]:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = live_heartbeats(client, StreamNames("up"))
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


def test_a_killed_service_is_restarted_and_the_run_completes(tiny_task: Path, tmp_path: Path, write_recipe) -> None:  # type: ignore[no-untyped-def]
    """Restarts are on by default: a reward killed mid-run comes back as reward-0.1 and the run reaches its
    last step; no service's password is in the output. Enough steps that the run cannot finish on what was
    already scored when the kill lands (with 4, a loaded machine reached the heartbeats late and the run completed
    within the 1 s restart delay, so no restart was due)."""
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url=None)
    log = tmp_path / "up.log"
    proc = start_up(recipe, log, total_steps=24)
    try:
        url = embedded_redis_url(tmp_path / "run", log)
        wait_for_heartbeats(url, log)
        children = descendants(proc)
        logins = [p.environ()["STREAMRL_REDIS__URL"] for p in children if "streamrl.ops.cli" in p.cmdline()]
        assert sorted(urlsplit(u).username or "" for u in logins) == sorted(SERVICES)  # each service its own user
        (reward,) = [p for p in children if "cli reward " in " ".join(p.cmdline())]
        reward.kill()
        assert proc.wait(480) == 0, log.read_text()[-4000:]
        assert_all_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "reward-0 exited with code -9: restart in 1.0 s" in text
    assert "started reward-0.1" in text and "the run is complete" in text
    passwords = [urlsplit(u).password for u in [url, *logins]]
    assert all(passwords) and not [p for p in passwords if p and p in text]  # no login in any line of the run
