"""``streamrl up`` with lanes: one embedded redis-server per lane (lane 0's the home), their URLs handed to every
service as ``lanes.urls``, a coordinator per lane and the rollout and reward counts per lane (each unit told its
lane), one learner; ``streamrl scale`` counts per lane. Real redis-servers, the real launcher; the backend
records what it is asked to start (no service runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis as syncredis

from streamrl.common.lanes import lane_names
from streamrl.common.run_info import read_run_info
from streamrl.ops.lane_plan import server_maxmemory, split_unit, unit_env
from streamrl.ops.launcher import Launcher
from streamrl.ops.redis_server import memory_settings
from streamrl.ops.replicas import Ended
from streamrl.ops.scaling import request_replicas

RECIPE = """
run_id = "lanes"
[lanes]
count = 2
[up]
display = false
replicas = {rollout = 2}
"""


class Recorded:
    """A backend that records the replicas it is asked to start and drain (none runs)."""

    def __init__(self, env: dict[str, str], service_env: dict[str, dict[str, str]]) -> None:
        self.env = env
        self.service_env = service_env
        self.started: list[tuple[str, int]] = []
        self.drained: list[tuple[str, int]] = []

    def start(self, service: str, index: int) -> None:
        self.started.append((service, index))

    def drain(self, service: str, index: int) -> None:
        self.drained.append((service, index))

    def poll(self) -> list[Ended]:
        return []

    def active(self, service: str) -> list[int]:
        live = [i for s, i in self.started if s == service]
        return [i for i in live if (service, i) not in self.drained]

    def occupied(self, service: str) -> list[int]:
        return [i for s, i in self.started if s == service]

    def stop_all(self) -> None:
        pass


def test_up_starts_a_redis_server_per_lane_and_places_each_lanes_services(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE)
    launcher = Launcher(str(recipe), [f"--run_dir={tmp_path / 'run'}"])
    backends: list[Recorded] = []
    monkeypatch.setattr(launcher, "_backend", lambda *env: backends.append(Recorded(*env)) or backends[-1])
    try:
        launcher.start()
        (backend,) = backends
        coordinator = backend.service_env["coordinator"]  # every service: its own login on every lane's server
        urls = json.loads(coordinator["STREAMRL_LANES__URLS"])
        assert urls[0] == coordinator["STREAMRL_REDIS__URL"]  # lane 0's is the home
        assert urls[0].endswith(f"@{launcher.redis_url.split('//')[1]}")  # type: ignore[union-attr]
        assert len(set(urls)) == 2 and all(syncredis.Redis.from_url(u).ping() for u in urls)
        assert all(u.startswith("redis://coordinator:") for u in urls)
        assert (tmp_path / "run" / "redis-lane1").is_dir()
        assert backend.started == [
            ("coordinator-lane0", 0),
            ("coordinator-lane1", 0),
            ("rollout-lane0", 0),
            ("rollout-lane0", 1),
            ("rollout-lane1", 0),
            ("rollout-lane1", 1),
            ("reward-lane0", 0),
            ("reward-lane1", 0),
            ("learner", 0),
        ]
        assert {unit_env(u)["STREAMRL_LANE"] for u, _ in backend.started if split_unit(u)[1] == 1} == {"1"}
        # `streamrl scale RUN reward=2`: two reward replicas in each lane
        assert launcher.client is not None
        request_replicas(launcher.client, launcher.names, {"reward": 2})
        launcher._reconcile()
        assert backend.started[9:] == [("reward-lane0", 1), ("reward-lane1", 1)]
        # `streamrl scale RUN rollout-lane1=3`: lane 1 alone; `rollout=1` again: every lane, lane 1's own cleared
        request_replicas(launcher.client, launcher.names, {"rollout-lane1": 3}, lanes=2)
        launcher._reconcile()
        assert backend.started[11:] == [("rollout-lane1", 2)] and not backend.drained
        request_replicas(launcher.client, launcher.names, {"rollout": 1}, lanes=2)
        launcher._reconcile()
        assert sorted(backend.drained) == [("rollout-lane0", 1), ("rollout-lane1", 1), ("rollout-lane1", 2)]
        # the run's memory bound is shared by the lanes' servers, not given whole to each
        total = launcher.embedded_maxmemory()
        each = [memory_settings(syncredis.Redis.from_url(launcher.login(u)))[0] for u in urls]  # the closed servers
        assert each == [server_maxmemory(total, 2)] * 2 and each[0] < total
        info = read_run_info(tmp_path / "run")
        assert launcher.redis is not None
        servers = [launcher.redis.url, *(server.url for server in launcher.lane_servers)]
        assert (info.lanes, info.lane_urls) == (2, servers)  # the servers' URLs: no login kept
        lane1 = syncredis.Redis.from_url(launcher.service_env("coordinator", urls[1], [])["STREAMRL_REDIS__URL"])
        lane1.set(lane_names("lanes", 1).state("probe"), 1)  # lane 1's keys live on its own server
        assert launcher.client.get(lane_names("lanes", 1).state("probe")) is None
        assert [names.run_id for _, names in launcher.lane_clients] == ["lanes/lane0", "lanes/lane1"]  # display
        launcher.lane_servers[0].stop()  # lane 1's Redis down: the display goes on, saying so
        capsys.readouterr()
        launcher._display()
        assert "unreachable=lane 1" in capsys.readouterr().out
    finally:
        launcher.stop()
    for url in urls:  # every embedded server stopped with the run
        with pytest.raises(syncredis.ConnectionError):
            syncredis.Redis.from_url(url, socket_connect_timeout=1).ping()
