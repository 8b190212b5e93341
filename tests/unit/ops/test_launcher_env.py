"""``[up] threads`` and ``[up] gpus``: each service process gets its own CPU thread count and GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.common.errors import ConfigError
from streamrl.ops.replicas import child_env
from streamrl.ops.up_config import UpConfig

ROOT = Path(__file__).resolve().parents[3]


def test_threads_cap_one_service_and_leave_the_others_inherited() -> None:
    base = {"OMP_NUM_THREADS": "2", "PATH": "/bin"}
    threads = UpConfig.model_validate({"threads": {"rollout": 1}}).threads
    rollout = child_env(base, "rollout-0", threads.get("rollout"))
    learner = child_env(base, "learner-0", threads.get("learner"))
    assert rollout["OMP_NUM_THREADS"] == "1" and rollout["STREAMRL_INSTANCE"] == "rollout-0"
    assert learner["OMP_NUM_THREADS"] == "2" and learner["PATH"] == "/bin"
    assert base["OMP_NUM_THREADS"] == "2"  # the launcher's own environment is untouched


def test_zero_threads_is_rejected() -> None:
    with pytest.raises((ConfigError, ValueError), match="threads"):
        UpConfig.model_validate({"threads": {"learner": 0}})


def test_gpus_place_each_replica_and_leave_unplaced_services_inherited() -> None:
    up = UpConfig.model_validate({"replicas": {"rollout": 2}, "gpus": {"rollout": ["0", "1"], "learner": "2"}})
    base = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    placed = {
        name: child_env(base, name, None, up.cuda_devices(service, i))["CUDA_VISIBLE_DEVICES"]
        for name, service, i in [("rollout-0", "rollout", 0), ("rollout-1", "rollout", 1), ("learner-0", "learner", 0)]
    }
    assert placed == {"rollout-0": "0", "rollout-1": "1", "learner-0": "2"}
    assert up.cuda_devices("reward", 0) is None
    assert child_env(base, "reward-0", None, up.cuda_devices("reward", 0))["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert "CUDA_VISIBLE_DEVICES" not in child_env({}, "reward-0", None, None)


def test_a_string_applies_to_every_replica_and_colocation_is_one_device() -> None:
    up = UpConfig.model_validate({"replicas": {"rollout": 3}, "gpus": {"rollout": "0", "learner": "0"}})
    assert [up.cuda_devices("rollout", i) for i in range(3)] == ["0", "0", "0"]
    assert up.cuda_devices("learner", 0) == "0"


def test_a_gpu_list_must_have_one_entry_per_replica() -> None:
    with pytest.raises(ValueError, match=r"up\.gpus\.rollout: 2 entries for 3 replica"):
        UpConfig.model_validate({"replicas": {"rollout": 3}, "gpus": {"rollout": ["0", "1"]}})
    with pytest.raises(ValueError, match=r"up\.gpus\.learner: 2 entries for 1 replica"):
        UpConfig.model_validate({"gpus": {"learner": ["0", "1"]}})


def test_gpus_of_an_unknown_service_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"up\.gpus\.rolout: unknown service"):
        UpConfig.model_validate({"gpus": {"rolout": "0"}})


def test_up_without_a_redis_server_says_so_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamrl.ops.launcher import main

    monkeypatch.setenv("STREAMRL_REDIS_SERVER", str(tmp_path / "missing-redis-server"))
    assert main([str(ROOT / "recipes" / "demo.toml"), f"--run_dir={tmp_path / 'run'}"]) == 2
    assert "STREAMRL_REDIS_SERVER" in capsys.readouterr().err
