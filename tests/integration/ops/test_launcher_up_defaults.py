"""``streamrl up``'s defaults: its embedded Redis is closed to anyone without the run's passwords, each
service logs in as its own ACL user, and a crashed replica is restarted until it crash-loops, which ends
the run with its last error on screen. Real redis-server and the real launcher; stand-in services (small
processes that check their Redis login, or crash). The real services under ``streamrl up``:
tests/e2e/test_launcher.py."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis as syncredis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from streamrl.common.run_info import read_run_info
from streamrl.common.streams import StreamNames
from streamrl.ops import local_backend
from streamrl.ops.embedded_auth import ACL_FILE, LAUNCHER_URL_FILE
from streamrl.ops.launcher import Launcher
from streamrl.ops.scale_cli import main as scale_main
from streamrl.ops.scaling import desired_replicas

RUN = "updefaults"
NAMES = StreamNames(RUN)
OUTPUT = {"coordinator": NAMES.batches, "rollout": NAMES.trajectories, "reward": NAMES.scored, "learner": NAMES.weights}
"""The stream each service publishes to (its ACL lets it XADD there)."""

PROBE = """
import json, os, pathlib, sys, time
import redis
service, instance, folder = sys.argv[1:4]
streams = json.loads(os.environ["PROBE_STREAMS"])
client = redis.Redis.from_url(os.environ["STREAMRL_REDIS__URL"])
seen = {}
for stream in sorted(set(streams.values())):
    try:
        client.xadd(stream, {"probe": service})
        seen[stream] = "ok"
    except redis.exceptions.NoPermissionError:
        seen[stream] = "refused"
pathlib.Path(folder, instance).write_text(json.dumps(seen))
while not (service == "coordinator" and pathlib.Path(folder, "finish").exists()):
    time.sleep(0.05)
"""
"""A service that logs in with the URL it was given, tries XADD on every service's output stream, writes what
happened to ``{folder}/{instance}``; the coordinator exits 0 once ``{folder}/finish`` exists."""

CRASHER = """
import pathlib, sys, time
service, instance, folder = sys.argv[1:4]
pathlib.Path(folder, instance).touch()
if service == "reward":
    print("loading scorer", flush=True)
    print("ValueError: reward.scorers[0]: boom", flush=True)
    print("shutting down", flush=True)
    sys.exit(int(pathlib.Path(folder, "code").read_text()))
while not pathlib.Path(folder, "finish").exists():
    time.sleep(0.05)
"""
"""The reward crashes at once with an error line (exit code: ``{folder}/code``); the others idle,
the coordinator exiting 0 once ``{folder}/finish`` exists."""


class Run:
    """A launcher with an embedded Redis running a stand-in script as every service, watched in a thread."""

    def __init__(
        self, tmp_path: Path, script: str, up: str, monkeypatch: pytest.MonkeyPatch, exit_code: int = 1
    ) -> None:
        self.folder = tmp_path / "alive"
        self.folder.mkdir()
        (self.folder / "code").write_text(str(exit_code))
        path = tmp_path / "stand_in.py"
        path.write_text(script)
        monkeypatch.setattr(
            local_backend,
            "service_command",
            lambda python, service, recipe, overrides, instance: [
                python,
                str(path),
                service,
                instance,
                str(self.folder),
            ],
        )
        monkeypatch.setenv("PROBE_STREAMS", json.dumps(OUTPUT))
        monkeypatch.delenv("STREAMRL_REDIS__URL", raising=False)
        self.run_dir = tmp_path / "run"
        recipe = tmp_path / "run.toml"
        recipe.write_text(f'run_id = "{RUN}"\nrun_dir = "{self.run_dir}"\n[up]\ndisplay = false\ngrace_s = 5\n{up}')
        self.launcher = Launcher(str(recipe), [])
        self.code: list[int] = []
        self.launcher.start()
        self.thread = threading.Thread(target=lambda: self.code.append(self.launcher.watch()), daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        assert self.launcher.redis is not None
        return self.launcher.redis.port

    def wait_for(self, condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def started(self) -> set[str]:
        return {p.name for p in self.folder.iterdir()} - {"code", "finish"}

    def finish(self, timeout_s: float = 60) -> int:
        self.thread.join(timeout=timeout_s)
        self.launcher.stop()
        assert self.code, "the launcher did not return"
        return self.code[0]


@pytest.fixture
def probes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Run]:
    run = Run(tmp_path, PROBE, "", monkeypatch)
    try:
        run.wait_for(lambda: {f"{s}-0" for s in OUTPUT} <= run.started(), "every service's probe")
        yield run
    finally:
        (run.folder / "finish").touch()
        run.finish()


def test_a_local_user_without_the_password_cannot_touch_the_runs_streams(probes: Run) -> None:
    stranger = syncredis.Redis(port=probes.port, socket_timeout=5)
    with pytest.raises(AuthenticationError):  # NOAUTH: the default user is off
        stranger.xadd(NAMES.batches, {"d": b"forged batch"})
    for user in ("default", "learner", "coordinator", "launcher"):
        guess = syncredis.Redis(port=probes.port, username=user, password="streamrl", socket_timeout=5)
        with pytest.raises(AuthenticationError):
            guess.ping()
    launcher = syncredis.Redis.from_url(read_run_info(probes.run_dir).url())
    assert launcher.xlen(NAMES.batches) == 1  # the coordinator's probe alone: nothing forged got in
    launcher.close()


def test_each_service_logs_in_as_itself_and_writes_only_its_own_stream(probes: Run) -> None:
    for service, output in OUTPUT.items():
        seen = json.loads((probes.folder / f"{service}-0").read_text())
        assert seen == {s: ("ok" if s == output else "refused") for s in OUTPUT.values()}, service


def test_the_launchers_login_reads_the_run_and_scales_it_and_nothing_more(
    probes: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    assert scale_main([str(probes.run_dir), "rollout=2"]) == 0  # streamrl scale finds the login from up.json
    launcher = syncredis.Redis.from_url(read_run_info(probes.run_dir).url())
    assert desired_replicas(launcher, NAMES) == {"rollout": 2, "reward": 1}
    assert launcher.info("memory")["maxmemory_policy"] == "noeviction"
    with pytest.raises(NoPermissionError):
        launcher.xadd(NAMES.batches, {"d": b"x"})
    with pytest.raises(ResponseError):  # NOPERM: no administration
        launcher.config_set("appendonly", "no")
    launcher.close()


def test_passwords_are_in_no_file_but_the_private_ones_and_in_no_output(
    probes: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    passwords = probes.launcher.passwords
    assert set(passwords) == {*OUTPUT, "observer", "launcher"} and all(len(p) >= 32 for p in passwords.values())
    data = probes.run_dir / "redis"
    for private in (data / ACL_FILE, data / LAUNCHER_URL_FILE):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    assert (
        (data / LAUNCHER_URL_FILE)
        .read_text()
        .strip()
        .endswith(f"launcher:{passwords['launcher']}@127.0.0.1:{probes.port}/0")
    )
    everywhere = {p: p.read_text(errors="replace") for p in probes.run_dir.rglob("*") if p.is_file()}
    for path, text in everywhere.items():
        shown = [u for u, p in passwords.items() if p in text]
        assert shown in ([], ["launcher"]) and (not shown or path.name == LAUNCHER_URL_FILE), (path, shown)
    out = capsys.readouterr()
    assert not [u for u, p in passwords.items() if p in out.out + out.err]


def test_a_crashed_replica_is_restarted_and_the_run_completes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = Run(tmp_path, PROBE, "restart_backoff_s = 0.1\n", monkeypatch)
    try:
        run.wait_for(lambda: "rollout-0" in run.started(), "rollout-0")
        assert run.launcher.replicas is not None
        (rollout,) = [r for r in run.launcher.replicas.running if r.name == "rollout-0"]  # type: ignore[attr-defined]
        os.kill(rollout.proc.pid, 9)
        run.wait_for(lambda: "rollout-0.1" in run.started(), "the restart")
        seen = json.loads((run.folder / "rollout-0.1").read_text())
        assert seen[NAMES.trajectories] == "ok" and seen[NAMES.batches] == "refused"  # logged in as rollout again
        (run.folder / "finish").touch()
    finally:
        code = run.finish()
    assert code == 0


def test_a_crash_loop_ends_the_run_with_its_last_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Run(tmp_path, CRASHER, "crash_loop_limit = 3\nrestart_backoff_s = 0.05\n", monkeypatch)
    code = run.finish()
    err = capsys.readouterr().err
    assert code == 1, err
    assert {"reward-0", "reward-0.1", "reward-0.2"} <= run.started() and "reward-0.3" not in run.started()
    assert "reward-0 exited with code 1: restart in 0.1 s (1 of 3 crashes within 600 s end the run)" in err
    assert (
        "service reward-0.2 failed (exit code 1; crashed 3 times within 600 s (up.crash_loop_limit = 3); "
        "last error: ValueError: reward.scorers[0]: boom)"
    ) in err
    assert "last lines of reward-0.2:\n    loading scorer\n    ValueError: reward.scorers[0]: boom" in err


def test_a_service_that_refuses_its_config_is_not_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Run(tmp_path, CRASHER, "restart_backoff_s = 0.05\n", monkeypatch, exit_code=2)
    code = run.finish()
    assert code == 1
    assert "reward-0.1" not in run.started()
    assert "it refuses its configuration (exit code 2): a restart would not help" in capsys.readouterr().err
