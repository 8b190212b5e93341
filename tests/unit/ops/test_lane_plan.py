"""``streamrl up`` with lanes: one coordinator per lane, rollout and reward replicas per lane (each told its
lane), one learner; one embedded redis-server per lane unless the recipe names its Redis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.common.config import ConfigError, apply_overrides, validate
from streamrl.common.lifecycle import ServiceConfig
from streamrl.ops.lane_plan import (
    embedded_servers,
    home_url,
    lanes_env,
    plan_processes,
    server_maxmemory,
    split_unit,
    unit_env,
    units,
)
from streamrl.ops.launcher import Launcher
from streamrl.ops.ray_backend import RayReplicas, ReplicaSpec
from streamrl.ops.up_config import SERVICES, LaunchRecipe, UpConfig

ROOT = Path(__file__).resolve().parents[3]


def test_every_lane_gets_a_coordinator_and_its_rollout_and_reward_replicas_one_learner_for_all() -> None:
    plan = plan_processes(SERVICES, {"rollout": 2}, lanes=2)
    assert [(p.name, p.service, p.lane, p.env) for p in plan] == [
        ("coordinator-lane0-0", "coordinator", 0, {"STREAMRL_LANE": "0"}),
        ("coordinator-lane1-0", "coordinator", 1, {"STREAMRL_LANE": "1"}),
        ("rollout-lane0-0", "rollout", 0, {"STREAMRL_LANE": "0"}),
        ("rollout-lane0-1", "rollout", 0, {"STREAMRL_LANE": "0"}),
        ("rollout-lane1-0", "rollout", 1, {"STREAMRL_LANE": "1"}),
        ("rollout-lane1-1", "rollout", 1, {"STREAMRL_LANE": "1"}),
        ("reward-lane0-0", "reward", 0, {"STREAMRL_LANE": "0"}),
        ("reward-lane1-0", "reward", 1, {"STREAMRL_LANE": "1"}),
        ("learner-0", "learner", None, {}),
    ]


def test_without_lanes_the_units_are_the_services_unchanged() -> None:
    assert units(SERVICES, 1) == list(SERVICES)
    assert [p.name for p in plan_processes(SERVICES, {"reward": 2}, lanes=1)] == [
        "coordinator-0",
        "rollout-0",
        "reward-0",
        "reward-1",
        "learner-0",
    ]
    assert unit_env("rollout") == {} and split_unit("learner") == ("learner", None)
    assert split_unit("rollout-lane12") == ("rollout", 12)


def test_one_embedded_redis_server_per_lane_none_when_the_recipe_names_one() -> None:
    assert embedded_servers(3, None, []) == 3
    assert embedded_servers(1, None, []) == 1
    assert embedded_servers(3, "redis://h:1", []) == 0  # every lane on redis.url
    assert embedded_servers(2, None, ["redis://a:1", "redis://b:2"]) == 0
    assert home_url(None, ["redis://a:1", "redis://b:2"]) == "redis://a:1"  # lane 0's is the home
    assert home_url("redis://h:1", ["redis://a:1", "redis://b:2"]) == "redis://h:1"


def test_the_lane_urls_reach_every_service_as_its_lanes_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    urls = ["redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002/0"]
    env = {**lanes_env(urls), "STREAMRL_LANE": "1", "STREAMRL_REDIS__URL": urls[0]}
    config = validate(ServiceConfig, apply_overrides({"lanes": {"count": 2}}, [], env=env), source="test")
    assert config.lanes.urls == urls and config.lane == 1
    assert lanes_env([]) == {}


def test_the_launcher_places_units_per_lane_and_refuses_autoscale_with_lanes(tmp_path: Path) -> None:
    recipe = tmp_path / "lanes.toml"
    recipe.write_text(f'run_id = "lanes"\nrun_dir = "{tmp_path / "run"}"\n[lanes]\ncount = 2\n')
    launcher = Launcher(str(recipe), [])
    assert launcher.units == [
        "coordinator-lane0",
        "coordinator-lane1",
        "rollout-lane0",
        "rollout-lane1",
        "reward-lane0",
        "reward-lane1",
        "learner",
    ]
    assert launcher.redis_url is None  # embedded: started with the run, one per lane
    with pytest.raises(ConfigError, match=r"autoscale\.enabled with lanes\.count = 2"):
        Launcher(str(recipe), ["--autoscale.enabled=true", '--autoscale.services={"rollout": {"max_replicas": 2}}'])
    given = Launcher(str(recipe), ['--lanes.urls=["redis://a:1/0","redis://b:2/0"]'])
    assert given.redis_url == "redis://a:1/0"  # no redis.url: lane 0's Redis is the home, nothing embedded


def test_a_recipe_with_more_lane_urls_than_lanes_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"lanes\.urls names 1 Redis URLs for lanes\.count = 2"):
        validate(LaunchRecipe, {"lanes": {"count": 2, "urls": ["redis://a:1"]}}, source="recipe x")
    assert json.loads(lanes_env(["redis://a:1"])["STREAMRL_LANES__URLS"]) == ["redis://a:1"]


class FakeActorClass:
    """What ``ray.remote(ServiceActor)`` gives, recording the specs of the actors it creates (no Ray here)."""

    def __init__(self) -> None:
        self.specs: list[ReplicaSpec] = []

    def options(self, **_: object) -> FakeActorClass:
        return self

    def remote(self, spec: ReplicaSpec | None = None) -> FakeActorClass:
        if spec is not None:  # a new actor (else its ``wait`` call)
            self.specs.append(spec)
        return self

    @property
    def wait(self) -> FakeActorClass:
        return self


def test_the_ray_backend_places_a_lanes_replica_as_its_service_told_its_lane() -> None:
    backend = object.__new__(RayReplicas)  # its __init__ starts Ray: the placement alone is under test
    backend.up = UpConfig.model_validate({"max_restarts": {"rollout": 2}})
    backend.run_id, backend.recipe, backend.overrides, backend.learner_ranks = "lanes", "r.toml", [], 1
    backend.env = {"STREAMRL_REDIS__URL": "redis://h:1/0"}
    backend.service_env = {"rollout": {"STREAMRL_REDIS__URL": "redis://rollout:pw@h:1/0"}}  # an embedded Redis's login
    backend.launcher_url = "redis://launcher:pw@h:1/0"
    backend.say = lambda *_, **__: None
    backend.replicas = {}
    backend.remote_actor = actors = FakeActorClass()
    backend.start("rollout-lane1", 0)
    backend.start("coordinator-lane0", 0)
    backend.start("learner", 0)
    rollout, coordinator, learner = actors.specs
    assert (rollout.service, rollout.unit, rollout.env["STREAMRL_LANE"]) == ("rollout", "rollout-lane1", "1")
    assert coordinator.until and coordinator.env["STREAMRL_LANE"] == "0"
    assert (learner.service, learner.unit, "STREAMRL_LANE" in learner.env) == ("learner", "", False)
    assert rollout.env["STREAMRL_REDIS__URL"] == "redis://rollout:pw@h:1/0"  # each service its own login
    assert learner.env["STREAMRL_REDIS__URL"] == "redis://h:1/0"
    assert rollout.launcher_url == learner.launcher_url == "redis://launcher:pw@h:1/0"  # incarnations counted
    assert set(backend.replicas) == {("rollout-lane1", 0), ("coordinator-lane0", 0), ("learner", 0)}
    assert backend.active("rollout-lane1") == [0] and backend.active("rollout-lane0") == []


def test_the_lanes_embedded_servers_share_the_runs_maxmemory() -> None:
    mib = 2**20
    assert server_maxmemory(0, 4) == 0  # no limit stays no limit
    assert server_maxmemory(1000 * mib, 1) == 1000 * mib
    assert server_maxmemory(1000 * mib, 4) == 250 * mib
    assert server_maxmemory(1001 * mib, 4) == 251 * mib  # rounded up to a MiB
    assert server_maxmemory(100 * mib, 4) == 64 * mib  # never below the floor
