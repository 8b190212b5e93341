"""Scaling rules without a server: replica plans and instance names, ``up.json``, the ``[up]`` fields of scaling
and Ray, Ray actor options, and a ``ray://`` cluster refused without a reachable Redis. The same on a live
run (the replicas hash, ``streamrl scale``, the local launcher) is tests/integration/ops/test_scaling_live.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.common.config import validate
from streamrl.common.errors import ConfigError
from streamrl.common.run_info import RunInfo, read_run_info, without_password, write_run_info
from streamrl.ops.launcher import Launcher
from streamrl.ops.ray_backend import actor_options, visible_devices
from streamrl.ops.scaling import instance_name, plan
from streamrl.ops.up_config import LaunchRecipe, ServiceResources, UpConfig


def test_plan_starts_at_the_next_free_index_and_drains_the_highest() -> None:
    assert plan(3, active=[0], occupied=[0]) == ([1, 2], [])
    assert plan(1, active=[0, 1, 2], occupied=[0, 1, 2]) == ([], [2, 1])
    assert plan(3, active=[0, 2], occupied=[0, 1, 2]) == ([3], [])  # 1 still draining: not free
    assert plan(2, active=[0, 1], occupied=[0, 1]) == ([], [])
    assert plan(0, active=[0], occupied=[0]) == ([], [0])


def test_instance_names_are_new_for_each_incarnation() -> None:
    assert [instance_name("rollout", 2, n) for n in range(3)] == ["rollout-2", "rollout-2.1", "rollout-2.2"]


def test_up_json_never_holds_a_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert without_password("redis://:s3cret@host:6380/0") == ("redis://host:6380/0", True)
    assert without_password("rediss://user:s3cret@host/1") == ("rediss://user@host/1", True)
    assert without_password("redis://127.0.0.1:1234/0") == ("redis://127.0.0.1:1234/0", False)
    write_run_info(tmp_path, RunInfo(run_id="r", redis_url="redis://:s3cret@host:6380/0"))
    assert "s3cret" not in (tmp_path / "up.json").read_text()
    info = read_run_info(tmp_path)
    monkeypatch.delenv("STREAMRL_REDIS__URL", raising=False)
    with pytest.raises(ConfigError, match="set STREAMRL_REDIS__URL"):
        info.url()
    monkeypatch.setenv("STREAMRL_REDIS__URL", "redis://:s3cret@host:6380/0")
    assert info.url() == "redis://:s3cret@host:6380/0"
    with pytest.raises(ConfigError, match=r"up\.json not found"):
        read_run_info(tmp_path / "elsewhere")


def test_up_config_checks_the_scaling_and_ray_fields() -> None:
    cases = [
        ({"resources": {"rolout": {"num_cpus": 1}}}, r"up\.resources\.rolout: unknown service"),
        ({"resources": {"learner": {"num_gpus": 1.5}}}, r"resources\.learner\.num_gpus: .*1\.5 is neither"),
        ({"resources": {"learner": {"num_gpu": 1}}}, r"up\.resources\.learner\.num_gpu: Extra inputs"),
        ({"max_replicas": {"learner": 2}}, r"up\.max_replicas\.learner: only"),
        ({"replicas": {"rollout": 3}, "max_replicas": {"rollout": 2}}, r"up\.max_replicas\.rollout: 2 is below"),
        ({"max_restarts": {"reward": -1}}, r"up\.max_restarts\.reward: -1 < 0"),
        ({"backend": "ray", "gpus": {"rollout": "0"}}, r"up\.gpus: the ray backend places GPUs by up\.resources"),
        ({"backend": "slurm"}, r"up\.backend: Input should be 'local' or 'ray'"),
    ]
    for data, match in cases:  # as `streamrl up` reports them: one line naming the field
        with pytest.raises(ConfigError, match=match):
            validate(LaunchRecipe, {"up": data}, source="recipe")
    up = UpConfig.model_validate(
        {"resources": {"rollout": {"num_gpus": 0.5}}, "gpus": {"rollout": ["0", "1"]}, "replicas": {"rollout": 2}}
    )
    assert up.resources_of("rollout").num_gpus == 0.5 and up.resources_of("reward") == ServiceResources()
    assert up.cuda_devices("rollout", 2) == "0"  # a replica added by scaling beyond the list: round robin


def test_ray_actor_options_reserve_every_learner_rank_and_hide_unasked_gpus() -> None:
    learner = actor_options("learner", ServiceResources(num_cpus=2, num_gpus=1), max_restarts=0, learner_ranks=4)
    assert (learner["num_cpus"], learner["num_gpus"], learner["max_restarts"]) == (8, 4, 0)
    rollout = actor_options("rollout", ServiceResources(num_gpus=0.5), max_restarts=3, learner_ranks=4)
    assert (rollout["num_gpus"], rollout["max_restarts"], rollout["max_task_retries"]) == (0.5, 3, -1)
    assert visible_devices(2, [3, 5]) == "3,5" and visible_devices(0, []) == ""


def test_a_ray_client_address_needs_a_redis_the_cluster_reaches(tmp_path: Path) -> None:
    recipe = tmp_path / "run.toml"
    recipe.write_text(f'run_dir = "{tmp_path / "run"}"\n[up]\nbackend = "ray"\nray_address = "ray://head:10001"\n')
    with pytest.raises(ConfigError, match=r"redis\.url: a Ray cluster reached through ray:// cannot reach"):
        Launcher(str(recipe), []).start()
    assert not (tmp_path / "run").exists()  # refused before anything started
