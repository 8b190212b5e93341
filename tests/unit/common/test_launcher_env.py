"""``[up] threads``: each service process gets its own CPU thread count."""

from __future__ import annotations

import pytest

from streamrl.common.errors import ConfigError
from streamrl.common.launcher import UpConfig, child_env


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
