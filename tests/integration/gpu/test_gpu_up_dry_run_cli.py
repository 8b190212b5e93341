"""`streamrl up <gpu recipe> --dry-run` in its own process: prints every service and starts nothing, names a bad value
and exits 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_gpu_up_dry_run import RECIPE, ROOT


def _up(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "streamrl.ops.cli", "up", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_dry_run_prints_every_service_and_starts_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "never"
    done = _up(
        RECIPE,
        "--dry-run",
        f"--run_dir={run_dir}",
        "--learner.weights_transport=zmq",
        '--up.gpus={"rollout": "1", "learner": "0"}',
    )
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)
    assert list(resolved) == ["up", "coordinator", "rollout", "reward", "learner"]
    assert resolved["up"]["up"]["gpus"] == {"rollout": "1", "learner": "0"}
    assert resolved["rollout"]["engine"]["device"] == "cuda"
    assert resolved["learner"]["weights_transport"] == "zmq"  # the override reached the service
    assert {resolved[s]["run_dir"] for s in resolved} == {str(run_dir)}
    assert not run_dir.exists()


@pytest.mark.timeout(300)
def test_dry_run_names_a_bad_value_and_exits_2() -> None:
    done = _up(RECIPE, "--learner.weights_transport=carrier-pigeon", "--dry-run")
    assert done.returncode == 2
    assert "learner refuses the recipe" in done.stderr and "weights_transport" in done.stderr
    assert "streamrl up:" in _up("--dry-run").stderr
