"""Scaling a live run: the replicas hash and its checks, ``streamrl scale``, and the local launcher's reconcile,
drain and restarts (real redis-server; stand-in services: small processes that only record that they run).
The rules without a server are tests/unit/ops/test_scaling.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as syncredis

from streamrl.common.codec import encode
from streamrl.common.lanes import lane_names
from streamrl.common.messages import Heartbeat
from streamrl.common.run_info import RunInfo, read_run_info, write_run_info
from streamrl.common.streams import StreamNames
from streamrl.ops import local_backend
from streamrl.ops.launcher import Launcher
from streamrl.ops.scale_cli import main as scale_main
from streamrl.ops.scale_cli import parse_counts
from streamrl.ops.scaling import desired_replicas, request_replicas

STAND_IN = """
import os, pathlib, signal, sys, time
service, instance, folder = sys.argv[1:4]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
pathlib.Path(folder, instance).write_text(str(os.getpid()))
while not (service == "coordinator" and pathlib.Path(folder, "finish").exists()):
    time.sleep(0.05)
"""
"""A service that writes ``{folder}/{instance}`` (its pid) when it starts, exits 0 on SIGTERM, and (the
coordinator) exits 0 once ``{folder}/finish`` exists."""


@pytest.fixture
def client(redis_url: str) -> Iterator[syncredis.Redis]:
    c = syncredis.Redis.from_url(redis_url)
    yield c
    c.close()


def test_counts_round_trip_through_the_run_hash(client: syncredis.Redis, run_id: str) -> None:
    names = StreamNames(run_id)
    assert desired_replicas(client, names) == {}
    request_replicas(client, names, {"rollout": 3, "reward": 2})
    request_replicas(client, names, {"rollout": 0})
    assert desired_replicas(client, names) == {"rollout": 0, "reward": 2}
    assert client.hgetall(names.state("replicas")) == {b"rollout": b"0", b"reward": b"2"}


@pytest.mark.parametrize(
    "counts,match",
    [
        ({"coordinator": 2}, "coordinator: a single-instance service cannot be scaled"),
        ({"learner": 2}, "learner: a single-instance service"),
        ({"rollot": 2}, "rollot: unknown service"),
        ({"rollout": -1}, "rollout: replica count must be an integer >= 0"),
        ({"reward": 1.5}, "integer"),
        ({"rollout": 9}, r"rollout: 9 replicas is over the maximum of 8"),
        ({}, "no replica count"),
    ],
)
def test_refused_counts_name_the_service_and_write_nothing(
    client: syncredis.Redis, run_id: str, counts: dict[str, int], match: str
) -> None:
    names = StreamNames(run_id)
    with pytest.raises(ValueError, match=match):
        # beside a valid count: nothing is written when any is refused
        request_replicas(client, names, {"reward": 1, **counts} if counts else {}, max_replicas={"rollout": 8})
    assert desired_replicas(client, names) == {}


def test_scale_command_on_a_run_dir_and_on_a_recipe(
    tmp_path: Path,
    redis_url: str,
    run_id: str,
    client: syncredis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STREAMRL_REDIS__URL", raising=False)
    write_run_info(tmp_path, RunInfo(run_id=run_id, redis_url=redis_url, max_replicas={"rollout": 4}))
    assert scale_main([str(tmp_path), "rollout=3", "reward=2"]) == 0
    out = capsys.readouterr().out
    assert "requested: rollout=3 reward=2" in out and "desired:   reward=2 rollout=3" in out
    assert "live now:  rollout=0 (-) reward=0 (-)" in out
    assert scale_main([str(tmp_path), "rollout=5"]) == 2
    assert "rollout: 5 replicas is over the maximum of 4" in capsys.readouterr().err
    assert scale_main([str(tmp_path), "learner=2"]) == 2
    assert "learner: a single-instance service cannot be scaled" in capsys.readouterr().err
    assert scale_main([str(tmp_path), "rollout=two"]) == 2
    recipe = tmp_path / "r.toml"  # no redis.url: the embedded server's, from {run_dir}/up.json
    recipe.write_text(f'run_id = "{run_id}"\nrun_dir = "{tmp_path}"\n')
    assert scale_main([str(recipe), "rollout=1"]) == 0
    assert desired_replicas(client, StreamNames(run_id)) == {"rollout": 1, "reward": 2}
    assert parse_counts(["rollout=2", "reward=0"]) == {"rollout": 2, "reward": 0}


def test_scale_command_on_a_run_with_lanes_scales_one_lane_and_shows_each_lanes_replicas(
    tmp_path: Path,
    redis_url: str,
    run_id: str,
    client: syncredis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STREAMRL_REDIS__URL", raising=False)
    monkeypatch.delenv("STREAMRL_LANES__URLS", raising=False)
    write_run_info(tmp_path, RunInfo(run_id=run_id, redis_url=redis_url, lanes=2, lane_urls=[redis_url, redis_url]))
    lane1 = lane_names(run_id, 1)  # lane 1's replica beats in lane 1
    beat = Heartbeat(service="rollout", instance="rollout-lane1-0", pid=1, ts=time.time())
    client.set(lane1.heartbeat("rollout", "rollout-lane1-0"), encode(beat), px=30_000)
    client.sadd(lane1.instances, "rollout:rollout-lane1-0")
    assert scale_main([str(tmp_path), "rollout-lane1=3"]) == 0
    out = capsys.readouterr().out
    assert "desired:   rollout-lane1=3" in out
    assert "rollout-lane0=0 (-)" in out and "rollout-lane1=1 (rollout-lane1-0)" in out
    assert scale_main([str(tmp_path), "rollout-lane2=1"]) == 2
    assert "rollout-lane2: lane 2 is not one of the run's 2 lanes" in capsys.readouterr().err
    assert scale_main([str(tmp_path), "coordinator-lane1=2"]) == 2
    assert scale_main([str(tmp_path), "rollout=2"]) == 0  # every lane; lane 1's own count cleared
    assert desired_replicas(client, StreamNames(run_id)) == {"rollout": 2}


class StandIns:
    """A launcher (local backend) running stand-in services, watched in a thread."""

    def __init__(self, tmp_path: Path, redis_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.folder = tmp_path / "alive"
        self.folder.mkdir()
        script = tmp_path / "stand_in.py"
        script.write_text(STAND_IN)
        monkeypatch.setattr(
            local_backend,
            "service_command",
            lambda python, service, recipe, overrides, instance: [
                python,
                str(script),
                service,
                instance,
                str(self.folder),
            ],
        )
        recipe = tmp_path / "run.toml"
        recipe.write_text(
            f'run_id = "{run_id}"\nrun_dir = "{tmp_path / "run"}"\n[redis]\nurl = "{redis_url}"\n'
            '[up]\nservices = ["coordinator", "rollout"]\ndisplay = false\ngrace_s = 5\n'
            "reconcile_interval_s = 0.1\nrestart_backoff_s = 0.1\nmax_restarts = {rollout = 2}\n"
        )
        self.launcher = Launcher(str(recipe), [])
        self.client = syncredis.Redis.from_url(redis_url)
        self.names = StreamNames(run_id)
        self.code: list[int] = []
        self.launcher.start()
        self.thread = threading.Thread(target=lambda: self.code.append(self.launcher.watch()), daemon=True)
        self.thread.start()

    def wait_for(self, condition, what: str, timeout_s: float = 20) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def started(self) -> set[str]:
        return {p.name for p in self.folder.iterdir()}

    def pid(self, instance: str) -> int:
        return int((self.folder / instance).read_text())

    def running(self) -> list[str]:
        assert self.launcher.replicas is not None
        return sorted(r.name for r in self.launcher.replicas.running if r.kill_at is None)  # type: ignore[attr-defined]

    def finish(self) -> int:
        self.thread.join(timeout=20)
        self.launcher.stop()
        self.client.close()
        assert self.code, "the launcher did not return"
        return self.code[0]


def test_local_launcher_scales_drains_and_restarts_under_new_names(
    tmp_path: Path, redis_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = StandIns(tmp_path, redis_url, run_id, monkeypatch)
    try:
        assert desired_replicas(run.client, run.names) == {"rollout": 1}  # the recipe's count, written at start
        assert read_run_info(tmp_path / "run").run_id == run_id
        run.wait_for(lambda: {"coordinator-0", "rollout-0"} <= run.started(), "the first replicas")
        request_replicas(run.client, run.names, {"rollout": 3})
        run.wait_for(lambda: run.running() == ["coordinator-0", "rollout-0", "rollout-1", "rollout-2"], "scale up")
        request_replicas(run.client, run.names, {"rollout": 1})
        run.wait_for(lambda: run.running() == ["coordinator-0", "rollout-0"], "scale down")
        seen: list[str] = []
        run.wait_for(
            lambda: seen.append(capsys.readouterr().out) or "rollout-2 removed (exit code 0)" in seen[-1],
            "the drained replica",
        )
        os.kill(run.pid("rollout-0"), signal.SIGKILL)  # a crash: restarted under a new name
        run.wait_for(lambda: "rollout-0.1" in run.started(), "the restart")
        request_replicas(run.client, run.names, {"rollout": 2})  # index 1 again: its second incarnation
        run.wait_for(lambda: run.running() == ["coordinator-0", "rollout-0.1", "rollout-1.1"], "re-creation")
        (run.folder / "finish").touch()
    finally:
        code = run.finish()
    assert code == 0
    assert "rollout-0 exited with code -9: restart in 0.1 s (1 of 5 crashes within 600 s end the run)" in (
        capsys.readouterr().err
    )


def test_local_launcher_fails_the_run_once_a_replica_has_no_restart_left(
    tmp_path: Path, redis_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = StandIns(tmp_path, redis_url, run_id, monkeypatch)
    try:
        for name in ("rollout-0", "rollout-0.1", "rollout-0.2"):
            run.wait_for(lambda name=name: name in run.started(), name)  # type: ignore[misc]
            os.kill(run.pid(name), signal.SIGKILL)
    finally:
        code = run.finish()
    assert code == 1
    assert "service rollout-0.2 failed (exit code -9; no restart left (up.max_restarts = 2)" in capsys.readouterr().err
