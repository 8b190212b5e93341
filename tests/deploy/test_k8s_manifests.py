"""The Kubernetes manifests of deploy/k8s (docs/kubernetes.md) render and validate offline, and wire the
services the way a run needs.

kubectl's built-in Kustomize renders the base and each overlay. Every object is validated against the
Kubernetes JSON schemas bundled by kubernetes-validate (strict: an unknown field fails), for the oldest
and the newest Kubernetes release checked here. KEDA's ScaledObject and TriggerAuthentication are
validated against the schemas in deploy/k8s/schemas/, which kubernetes-validate does not have. The
Secrets that deploy/k8s/make-secrets.sh prints are validated too, and every Secret key the manifests
read must be one of them.

Then each service's config is loaded the way its container loads it: the recipe from the rendered
ConfigMap and the container's environment (ConfigMap and Secret references resolved, ``$(VAR)``
expanded). The tests check the Redis URL, the run id and folder, the metrics endpoint, the probes,
the drain time, the GPUs, and the KEDA triggers' streams and groups. A real redis-server with the
run's ACL file shows that KEDA's login can run the command its trigger sends.

Nothing here needs a cluster. kubectl is required (CI has it): without it the tests fail and say how
to install it. They do not skip.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import redis
import tomllib
import yaml

from streamrl.common.config import load_config, read_recipe
from streamrl.common.lanes import check_lane, lane_names
from streamrl.common.lifecycle import ServiceConfig
from streamrl.common.streams import StreamNames
from streamrl.coordinator.config import CoordinatorConfig
from streamrl.learner.rl.config import LearnerConfig
from streamrl.ops.redis_acl import PASSWORD_ENV, USERS, acl_file, check_password
from streamrl.ops.redis_server import find_redis_server, free_port
from streamrl.reward.__main__ import RewardServiceConfig
from streamrl.rollout.config import RolloutConfig

try:
    import kubernetes_validate
except ImportError as e:  # a clear failure, never a skip: CI must run these tests
    raise ImportError(
        "tests/deploy needs kubernetes-validate (the Kubernetes JSON schemas, offline): "
        ".venv/bin/pip install -c constraints.txt -r requirements-dev.txt"
    ) from e

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
SCHEMAS = K8S / "schemas"
OVERLAYS = {
    "base": K8S / "base",
    "cpu": K8S / "overlays" / "cpu",
    "external-redis": K8S / "overlays" / "external-redis",
    "lanes": K8S / "overlays" / "lanes",
}
KUBERNETES_VERSIONS = ("1.29", "1.37")
"""Releases the objects must be valid for: the oldest and the newest checked here."""
KEDA_SCHEMAS = {"ScaledObject": "keda-scaledobject.json", "TriggerAuthentication": "keda-triggerauthentication.json"}
SERVICES = ("coordinator", "rollout", "reward", "learner")
LANE_SERVICES = ("coordinator", "rollout", "reward")
"""Services that serve one lane each in a run with lanes (streamrl.common.lanes.check_lane)."""
LANE_LABEL = "streamrl.io/lane"
SINGLE = ("coordinator", "learner")
SCALED = {"rollout": ("prompts", "rollout"), "reward": ("trajectories", "reward")}
"""Autoscaled service -> (its input stream in StreamNames, its consumer group). The groups are the
service names: streamrl.rollout.service and streamrl.reward.service consume as "rollout" and "reward"."""
CONFIG_CLASSES: dict[str, type[ServiceConfig]] = {
    "coordinator": CoordinatorConfig,
    "rollout": RolloutConfig,
    "reward": RewardServiceConfig,
    "learner": LearnerConfig,
}
GPU = "nvidia.com/gpu"
NAMESPACE = "streamrl"
KUBECTL_HELP = (
    "kubectl is not on PATH. The Kubernetes manifests are rendered offline with `kubectl kustomize` "
    "(Kustomize v5 is built into kubectl 1.27 and later). Install kubectl, e.g. on Debian/Ubuntu "
    "`apt-get install kubectl` from the Kubernetes package repository, or put its static binary in "
    "/usr/local/bin, then run again."
)


# -- rendering -------------------------------------------------------------------------------------


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(KUBECTL_HELP, pytrace=False)
    return path


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize folder`` renders."""
    result = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {folder.relative_to(REPO)}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


_RENDERED: dict[str, list[dict[str, Any]]] = {}


def rendered(overlay: str) -> list[dict[str, Any]]:
    if overlay not in _RENDERED:
        _RENDERED[overlay] = kustomize(OVERLAYS[overlay])
    return copy.deepcopy(_RENDERED[overlay])


def make_secrets(
    namespace: str = NAMESPACE, env: dict[str, str] | None = None, lanes: int = 1
) -> dict[str, dict[str, str]]:
    """Secret name -> its string data, as deploy/k8s/make-secrets.sh prints them (for ``lanes`` lanes)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_") and k != "HF_TOKEN"}
    result = subprocess.run(
        [str(K8S / "make-secrets.sh"), namespace, str(lanes)],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    for doc in docs:
        validate_object(doc)
    return {doc["metadata"]["name"]: doc["stringData"] for doc in docs}


_SECRETS: dict[int, dict[str, dict[str, str]]] = {}


def default_secrets(lanes: int = 1) -> dict[str, dict[str, str]]:
    """What make-secrets.sh prints for the namespace of the base and ``lanes`` lanes, made once per test session."""
    if lanes not in _SECRETS:
        _SECRETS[lanes] = make_secrets(lanes=lanes)
    return copy.deepcopy(_SECRETS[lanes])


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def workload(objects: list[dict[str, Any]], service: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] in ("StatefulSet", "Deployment") and o["metadata"]["name"] == service]
    return found


def container(objects: list[dict[str, Any]], service: str, name: str | None = None) -> dict[str, Any]:
    """The container of ``service`` in the workload ``name`` (default: the service's own, lane 0's with lanes)."""
    (found,) = [c for c in pod_spec(workload(objects, name or service))["containers"] if c["name"] == service]
    return found


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def recipe_configmap(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("streamrl-recipe")]
    return found


def run_id(objects: list[dict[str, Any]]) -> str:
    value: str = recipe_configmap(objects)["data"]["run-id"]
    return value


def lanes_count(objects: list[dict[str, Any]]) -> int:
    """The recipe's lanes.count (1: no lanes)."""
    count: int = read_recipe_text(recipe_configmap(objects)["data"]["recipe.toml"]).get("lanes", {}).get("count", 1)
    return count


def service_workloads(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str]]:
    """Every workload running a streamrl service (each lane's copy too), with that service."""
    found = []
    for obj in workloads(objects):
        for c in pod_spec(obj)["containers"]:
            if c.get("command", [])[:1] == ["streamrl"]:
                found.append((obj, c["command"][1]))
    return found


def all_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(obj)
    return [*spec.get("initContainers", []), *spec["containers"]]


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("StatefulSet", "Deployment")]


# -- validation ------------------------------------------------------------------------------------


def keda_validator(kind: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / KEDA_SCHEMAS[kind]).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator: jsonschema.protocols.Validator = cls(schema)
    return validator


def validate_object(obj: dict[str, Any]) -> None:
    """Raise a ValidationError if ``obj`` is not valid for every checked Kubernetes release (KEDA
    kinds: against deploy/k8s/schemas)."""
    if obj["apiVersion"].startswith("keda.sh/"):
        keda_validator(obj["kind"]).validate(obj)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renders_and_every_object_validates(overlay: str) -> None:
    objects = rendered(overlay)
    assert objects
    problems = []
    for obj in objects:
        try:
            validate_object(obj)
        except (jsonschema.ValidationError, kubernetes_validate.utils.SchemaNotFoundError) as e:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {getattr(e, 'message', e)}")
    assert not problems, "\n".join(problems)


def test_the_validation_catches_mistakes() -> None:
    objects = rendered("base")
    scaled = find(objects, "ScaledObject", "rollout")
    auth = find(objects, "TriggerAuthentication", "streamrl-redis-observer")
    mistakes = []
    bad = copy.deepcopy(scaled)
    bad["spec"]["triggers"][0]["metadata"]["pendingEntriesCount"] = 24  # KEDA reads strings only
    mistakes.append(bad)
    bad = copy.deepcopy(scaled)
    bad["spec"]["triggers"][0]["metadata"]["pendingEntryCount"] = "24"  # misspelt: KEDA would ignore it
    mistakes.append(bad)
    bad = copy.deepcopy(scaled)
    del bad["spec"]["triggers"][0]["metadata"]["stream"]
    mistakes.append(bad)
    bad = copy.deepcopy(scaled)
    bad["spec"]["maxReplicas"] = bad["spec"].pop("maxReplicaCount")  # the HPA's name, not KEDA's
    mistakes.append(bad)
    bad = copy.deepcopy(auth)
    del bad["spec"]["secretTargetRef"][0]["key"]
    mistakes.append(bad)
    deployment = find(objects, "Deployment", "rollout")
    bad = copy.deepcopy(deployment)
    bad["spec"]["replica"] = 2  # strict Kubernetes schema: unknown field
    mistakes.append(bad)
    bad = copy.deepcopy(deployment)
    pod_spec(bad)["containers"][0]["resources"]["limits"]["memory"] = ["32Gi"]
    mistakes.append(bad)
    for obj in mistakes:
        with pytest.raises(jsonschema.ValidationError):
            validate_object(obj)
    for obj in (scaled, auth, deployment):
        validate_object(obj)


def test_kubectl_missing_fails_and_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(pytest.fail.Exception, match=r"kubectl is not on PATH\..*Install kubectl"):
        kubectl()


# -- what the base holds ---------------------------------------------------------------------------


def test_base_holds_redis_the_four_services_the_recipe_the_runs_volume_and_keda() -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered("base") if o["kind"] != "ConfigMap"}
    assert kinds == {
        ("Service", "redis"),
        ("StatefulSet", "redis"),
        ("Service", "coordinator"),
        ("StatefulSet", "coordinator"),
        ("Service", "learner"),
        ("StatefulSet", "learner"),
        ("Deployment", "rollout"),
        ("Deployment", "reward"),
        ("PersistentVolumeClaim", "streamrl-runs"),
        ("ScaledObject", "rollout"),
        ("ScaledObject", "reward"),
        ("TriggerAuthentication", "streamrl-redis-observer"),
    }
    assert all(o["metadata"]["namespace"] == NAMESPACE for o in rendered("base"))


def test_redis_has_a_memory_limit_below_its_containers_and_never_evicts() -> None:
    (container,) = find(rendered("base"), "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    maxmemory = command[command.index("--maxmemory") + 1]
    limit = container["resources"]["limits"]["memory"]
    assert maxmemory.endswith("gb") and limit.endswith("Gi")
    assert int(maxmemory[:-2]) < int(limit[:-2]), "leave the AOF rewrite's fork room under the container limit"


def test_external_redis_overlay_drops_the_redis_and_nothing_else() -> None:
    base = {(o["kind"], o["metadata"]["name"]) for o in rendered("base")}
    external = {(o["kind"], o["metadata"]["name"]) for o in rendered("external-redis")}
    assert base - external == {("Service", "redis"), ("StatefulSet", "redis")}
    assert external <= base


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_coordinator_and_learner_run_exactly_one_instance(overlay: str) -> None:
    objects = rendered(overlay)
    for service in SINGLE:
        obj = workload(objects, service)
        # A StatefulSet never runs two pods of one ordinal; a Deployment would need strategy Recreate.
        assert obj["kind"] == "StatefulSet" or obj["spec"]["strategy"]["type"] == "Recreate", service
        assert obj["spec"]["replicas"] == 1, service


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollout_and_reward_leave_the_replica_count_to_keda(overlay: str) -> None:
    for service in SCALED:
        obj = workload(rendered(overlay), service)
        assert obj["kind"] == "Deployment"
        assert "replicas" not in obj["spec"], f"{service}: re-applying would reset what KEDA chose"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_runs_its_own_command_and_reads_the_mounted_recipe(overlay: str) -> None:
    objects = rendered(overlay)
    configmap = recipe_configmap(objects)
    assert {service for _, service in service_workloads(objects)} == set(SERVICES)
    for obj, service in service_workloads(objects):
        main = container(objects, service, obj["metadata"]["name"])
        assert main["command"] == ["streamrl", service]
        env = {e["name"]: e for e in main["env"]}
        recipe = env["STREAMRL_RECIPE"]["value"]
        mount = next(m for m in main["volumeMounts"] if recipe.startswith(m["mountPath"] + "/"))
        assert mount.get("readOnly") is True
        volume = next(v for v in pod_spec(obj)["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == configmap["metadata"]["name"]
        (item,) = volume["configMap"]["items"]
        assert recipe == f"{mount['mountPath']}/{item['path']}" and item["key"] == "recipe.toml"
        run_id_ref = {"name": configmap["metadata"]["name"], "key": "run-id"}
        assert env["STREAMRL_RUN_ID"]["valueFrom"]["configMapKeyRef"] == run_id_ref
        # each consumer is named after its pod: unique per replica
        assert env["STREAMRL_INSTANCE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_url_and_every_credential_come_from_a_secret(overlay: str) -> None:
    objects = rendered(overlay)
    for obj, service in service_workloads(objects):
        env = {e["name"]: e for e in container(objects, service, obj["metadata"]["name"])["env"]}
        assert env["STREAMRL_REDIS__URL"]["valueFrom"] == {
            "secretKeyRef": {"name": "streamrl-redis", "key": f"url-{service}"}
        }
    secret_like = re.compile(r"PASSWORD|_TOKEN$|_KEY$|^REDISCLI_AUTH$|__URLS?(__\d+)?$")
    checked = set()
    for obj in workloads(objects):
        for c in all_containers(obj):
            for e in c.get("env", []):
                where = f"{obj['metadata']['name']}/{c['name']}: {e['name']}"
                assert "redis://" not in e.get("value", ""), where
                if secret_like.search(e["name"]):
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{where} is not read from a Secret"
                    checked.add(e["name"])
    assert {"STREAMRL_REDIS__URL", "STREAMRL_WEIGHTS_KEY", "STREAMRL_METRICS_TOKEN", "HF_TOKEN"} <= checked
    if overlay != "external-redis":
        assert {"REDISCLI_AUTH", PASSWORD_ENV.format(user="OBSERVER")} <= checked


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_key_the_manifests_read_is_one_make_secrets_writes(overlay: str) -> None:
    secrets = default_secrets(lanes_count(rendered(overlay)))
    refs = [
        (e["valueFrom"]["secretKeyRef"], f"{obj['metadata']['name']}/{c['name']}")
        for obj in workloads(rendered(overlay))
        for c in all_containers(obj)
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    ]
    refs += [
        ({"name": r["name"], "key": r["key"]}, f"TriggerAuthentication/{o['metadata']['name']}")
        for o in rendered(overlay)
        if o["kind"] == "TriggerAuthentication"
        for r in o["spec"]["secretTargetRef"]
    ]
    assert refs
    for ref, where in refs:
        if not ref.get("optional"):
            assert ref["key"] in secrets.get(ref["name"], {}), f"{where}: {ref['name']}/{ref['key']}"


def test_make_secrets_writes_a_password_and_own_url_per_user_and_keeps_given_passwords() -> None:
    secrets = make_secrets("team-a")
    redis_secret = secrets["streamrl-redis"]
    for user in USERS:
        check_password(user, redis_secret[f"password-{user}"])
    for service in SERVICES:
        assert redis_secret[f"url-{service}"] == f"redis://{service}:{redis_secret[f'password-{service}']}@redis:6379/0"
    # KEDA runs in its own namespace: it needs the service's name in this one
    assert redis_secret["keda-address"] == "redis.team-a.svc:6379"
    assert redis_secret["keda-username"] == "observer"
    assert len(set(secrets["streamrl-keys"].values())) == 2 and "hf-token" not in secrets["streamrl-keys"]
    again = make_secrets("team-a")["streamrl-redis"]
    assert again["password-rollout"] != redis_secret["password-rollout"], "new random passwords each time"
    given = {PASSWORD_ENV.format(user="ROLLOUT"): "rollout-password-from-dot-env", "HF_TOKEN": "hf_test"}
    kept = make_secrets("team-a", env=given)
    assert kept["streamrl-redis"]["url-rollout"] == "redis://rollout:rollout-password-from-dot-env@redis:6379/0"
    assert kept["streamrl-keys"]["hf-token"] == "hf_test"


# -- each service's config, as its container loads it ----------------------------------------------


def resolve_env(
    spec: list[dict[str, Any]], objects: list[dict[str, Any]], secrets: dict[str, dict[str, str]], pod: str
) -> dict[str, str]:
    """A container's environment as the kubelet builds it: references resolved, ``$(VAR)`` expanded
    from the variables defined before it."""
    configmaps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for item in spec:
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), item["value"])
            continue
        source = item["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[item["name"]] = configmaps[ref["name"]][ref["key"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            if ref["key"] in secrets[ref["name"]]:
                env[item["name"]] = secrets[ref["name"]][ref["key"]]
            else:
                assert ref.get("optional"), f"{item['name']}: no key {ref['key']} in Secret {ref['name']}"
        else:
            assert source == {"fieldRef": {"fieldPath": "metadata.name"}}, item
            env[item["name"]] = pod
    return env


def load_service_config(
    overlay: str, service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str | None = None
) -> tuple[ServiceConfig, dict[str, str], dict[str, dict[str, str]]]:
    """``service``'s config as its container in the workload ``name`` (default: the service's own) loads it;
    also its environment and the Secrets used."""
    objects = rendered(overlay)
    secrets = default_secrets(lanes_count(objects))
    name = name or service
    env = resolve_env(container(objects, service, name)["env"], objects, secrets, pod=f"{name}-0")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(recipe_configmap(objects)["data"]["recipe.toml"])
    for var in [v for v in os.environ if v.startswith(("STREAMRL_", "OTEL_"))]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("STREAMRL_RECIPE", str(recipe))
    return load_config(CONFIG_CLASSES[service], recipe, section=service), env, secrets


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_config_loads_in_its_container_environment(
    overlay: str, service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, env, secrets = load_service_config(overlay, service, tmp_path, monkeypatch)
    objects = rendered(overlay)
    assert config.redis.url == secrets["streamrl-redis"][f"url-{service}"]
    assert config.run_id == run_id(objects)
    assert config.run_dir == f"runs/{config.run_id}"
    runs = next(m for m in container(objects, service)["volumeMounts"] if m["name"] == "runs")
    assert runs["mountPath"] == "/app/" + config.run_dir.split("/")[0], "the run folder is on the runs volume"
    assert env["STREAMRL_INSTANCE"] == f"{service}-0"
    # /metrics on every interface of the pod, behind the token from the Secret, on the annotated port
    assert config.prometheus.host == "0.0.0.0" and config.prometheus.token_env is not None
    assert env[config.prometheus.token_env] == secrets["streamrl-keys"]["metrics-token"]
    ports = {p["name"]: p["containerPort"] for p in container(objects, service)["ports"]}
    annotations = workload(objects, service)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert ports["metrics"] == config.prometheus.port == int(annotations["prometheus.io/port"])
    # SIGTERM drains for consumer.shutdown_grace_s; the pod is killed only after that
    grace = pod_spec(workload(objects, service))["terminationGracePeriodSeconds"]
    assert grace >= config.consumer.shutdown_grace_s + 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_learner_weight_server_is_reachable_through_its_service(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _, _ = load_service_config(overlay, "learner", tmp_path, monkeypatch)
    assert isinstance(config, LearnerConfig)
    objects = rendered(overlay)
    assert config.weights_host == "0.0.0.0" and config.weights_transport == "zmq"
    service = find(objects, "Service", config.weights_advertise_host or "")
    labels = workload(objects, "learner")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == config.weights_port]
    assert {p["name"]: p["containerPort"] for p in container(objects, "learner")["ports"]}[port["targetPort"]] == (
        config.weights_port
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_run_the_service_check(overlay: str) -> None:
    objects = rendered(overlay)
    for obj, service in service_workloads(objects):
        main = container(objects, service, obj["metadata"]["name"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["exec"]["command"] == ["streamrl", service, "--check"], f"{service} {probe}"


def test_gpus_match_the_recipe_in_the_base_and_the_cpu_overlay_asks_for_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = rendered("base")
    rollout, _, _ = load_service_config("base", "rollout", tmp_path, monkeypatch)
    learner, _, _ = load_service_config("base", "learner", tmp_path, monkeypatch)
    assert isinstance(rollout, RolloutConfig) and isinstance(learner, LearnerConfig)
    limits = {service: container(objects, service)["resources"].get("limits", {}) for service in SERVICES}
    assert limits["rollout"][GPU] == rollout.engine.tensor_parallel_size
    assert limits["learner"][GPU] == learner.ranks
    assert GPU not in limits["coordinator"] and GPU not in limits["reward"]
    assert ":dev-gpu" in container(objects, "rollout")["image"] and ":dev-gpu" in container(objects, "learner")["image"]
    cpu = rendered("cpu")
    for obj in workloads(cpu):
        for c in all_containers(obj):
            assert GPU not in json.dumps(c.get("resources", {})), f"{obj['metadata']['name']}/{c['name']}"
            assert "gpu" not in c["image"], c["image"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_runs_volume_is_shared_and_the_learner_prepares_what_the_others_wait_for(overlay: str) -> None:
    objects = rendered(overlay)
    claim = find(objects, "PersistentVolumeClaim", "streamrl-runs")
    modes = claim["spec"]["accessModes"]
    assert modes == (["ReadWriteOnce"] if overlay == "cpu" else ["ReadWriteMany"]), "pods on several nodes need RWX"
    for obj, _ in service_workloads(objects):
        volumes = {v["name"]: v for v in pod_spec(obj)["volumes"]}
        assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == "streamrl-runs", obj["metadata"]["name"]
    configmap = recipe_configmap(objects)
    data = read_recipe_text(configmap["data"]["recipe.toml"])
    out_dir = data["prepare"]["out_dir"]
    assert configmap["data"]["prepared"] == f"{out_dir}/prepare.json"
    coordinator = data["coordinator"]
    inputs = [
        coordinator["dataset"]["path"],
        coordinator["dataset"]["tokenizer"],
        coordinator["eval"]["dataset"]["path"],
        data["rollout"]["engine"]["model"],
        data["learner"]["model"],
    ]
    assert out_dir.startswith("runs/") and all(p.startswith(out_dir + "/") for p in inputs), inputs
    learner = workload(objects, "learner")
    (prepare,) = pod_spec(learner)["initContainers"]
    assert prepare["image"] == container(objects, "learner")["image"], "the learner image holds examples/"
    assert prepare["command"][:2] == ["python", "examples/arithmetic/prepare.py"]
    assert (REPO / prepare["command"][1]).is_file() and prepare["command"][2] == "$(STREAMRL_RECIPE)"
    assert {e["name"]: e["value"] for e in prepare["env"]}["STREAMRL_RECIPE"] == (
        {e["name"]: e.get("value") for e in container(objects, "learner")["env"]}["STREAMRL_RECIPE"]
    )
    for obj, service in service_workloads(objects):
        if service not in ("coordinator", "rollout"):
            continue
        (wait,) = pod_spec(obj)["initContainers"]
        assert wait["env"][0]["valueFrom"]["configMapKeyRef"]["key"] == "prepared", obj["metadata"]["name"]
        assert '[ -f "$PREPARED_FILE" ]' in wait["command"][-1]


def names_of(config: ServiceConfig) -> StreamNames:
    """The keys a service instance uses: its lane's when it serves one, else the run's (as lifecycle.where)."""
    if config.lanes.enabled and config.lane is not None:
        return lane_names(config.run_id, config.lane)
    return StreamNames(config.run_id)


def read_recipe_text(text: str) -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads(text)
    return data


def test_the_base_recipe_is_the_file_beside_the_kustomization() -> None:
    on_disk = read_recipe(K8S / "base" / "recipe.toml")
    assert read_recipe_text(recipe_configmap(rendered("base"))["data"]["recipe.toml"]) == on_disk
    assert "run_id" not in on_disk and "run_dir" not in on_disk, "the ConfigMap's run-id sets both"


def test_redis_persists_with_aof_and_loads_the_acl_file_of_the_run() -> None:
    objects = rendered("base")
    statefulset = workload(objects, "redis")
    (server,) = pod_spec(statefulset)["containers"]
    command = server["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    data_dir = command[command.index("--dir") + 1]
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": data_dir} in server["volumeMounts"]
    (acl,) = pod_spec(statefulset)["initContainers"]
    assert acl["command"] == ["python", "-m", "streamrl.ops.redis_acl"]
    args = acl["args"]
    assert args[0] == "acl" and args[args.index("--out") + 1] == command[command.index("--aclfile") + 1]
    assert args[args.index("--run-id") + 1] == "$(STREAMRL_RUN_ID)"
    env = resolve_env(acl["env"], objects, default_secrets(), pod="redis-0")
    assert env["STREAMRL_RUN_ID"] == run_id(objects)
    assert acl_file(env["STREAMRL_RUN_ID"], {u: env[PASSWORD_ENV.format(user=u.upper())] for u in USERS})


# -- KEDA ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", SCALED)
def test_scaled_objects_target_the_deployment_on_its_input_stream_and_group(
    overlay: str, service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = rendered(overlay)
    scaled = find(objects, "ScaledObject", service)["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": service}
    assert container(objects, service)["command"] == ["streamrl", service]
    assert 1 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"]
    behavior = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 60, "a cooldown before removing replicas"
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "redis-streams"
    stream, group = SCALED[service]
    meta = trigger["metadata"]
    config, _, _ = load_service_config(overlay, service, tmp_path, monkeypatch)
    assert meta["stream"] == getattr(names_of(config), stream)
    assert meta["consumerGroup"] == group
    # A replica holds at most max_in_flight pending entries: a target at or above it never scales up.
    assert 0 < int(meta["pendingEntriesCount"]) < config.consumer.max_in_flight
    auth = find(objects, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    params = {r["parameter"] for r in auth["spec"]["secretTargetRef"]}
    assert {"address", "username", "password"} <= params


def render_acl(overlay: str, statefulset: str, out: Path) -> dict[str, str]:
    """Run the ``acl`` init container of the Redis ``statefulset`` here, as its pod runs it (its command, its
    arguments and environment resolved), writing the file to ``out``; returns each user's password."""
    objects = rendered(overlay)
    secrets = default_secrets(lanes_count(objects))
    (init,) = pod_spec(workload(objects, statefulset))["initContainers"]
    env = resolve_env(init["env"], objects, secrets, pod=f"{statefulset}-0")
    args = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m[1]], a) for a in init["args"]]
    args[args.index("--out") + 1] = str(out)
    assert init["command"][0] == "python"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    result = subprocess.run(
        [sys.executable, *init["command"][1:], *args], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return {user: secrets["streamrl-redis"][f"password-{user}"] for user in USERS}


@contextlib.contextmanager
def serve_acl(folder: Path, passwords: dict[str, str]) -> Iterator[int]:
    """redis-server with the ACL file ``folder/users.acl``; yields its port."""
    port = free_port()
    proc = subprocess.Popen(
        [
            find_redis_server(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            "--save",
            "",
            "--appendonly",
            "no",
            "--aclfile",
            str(folder / "users.acl"),
            "--logfile",
            "redis.log",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        observer = redis.Redis(port=port, username="observer", password=passwords["observer"], socket_timeout=5)
        deadline = time.monotonic() + 10
        while True:
            try:
                observer.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, dict[str, str]]]:
    """redis-server with the ACL file the base's init container renders (its run id, make-secrets' passwords)."""
    folder = tmp_path_factory.mktemp("k8s-acl")
    passwords = render_acl("base", "redis", folder / "users.acl")
    with serve_acl(folder, passwords) as port:
        yield port, passwords


@pytest.mark.parametrize("service", SCALED)
def test_kedas_login_may_read_what_its_trigger_reads(service: str, acl_redis: tuple[int, dict[str, str]]) -> None:
    port, passwords = acl_redis
    meta = find(rendered("base"), "ScaledObject", service)["spec"]["triggers"][0]["metadata"]
    # the consumer group exists once the service's own user created it on its stream
    consumer = redis.Redis(port=port, username=service, password=passwords[service], socket_timeout=5)
    try:
        consumer.xgroup_create(meta["stream"], meta["consumerGroup"], id="0", mkstream=True)
    except redis.ResponseError as e:
        assert "BUSYGROUP" in str(e)
    observer = redis.Redis(port=port, username="observer", password=passwords["observer"], socket_timeout=5)
    assert observer.ping()
    assert observer.xpending(meta["stream"], meta["consumerGroup"])["pending"] == 0
    # INFO (which KEDA's lagCount mode sends first) is not the observer's: that is why the triggers
    # count pending entries
    with pytest.raises(redis.exceptions.NoPermissionError):
        observer.info()


# -- lanes (overlays/lanes: lanes.count = 2) -------------------------------------------------------

LANE1 = ("Service/redis", "StatefulSet/redis", "Service/coordinator", "StatefulSet/coordinator")
LANE1 += ("Deployment/rollout", "Deployment/reward", "ScaledObject/rollout", "ScaledObject/reward")
LANE1 += ("TriggerAuthentication/streamrl-redis-observer",)
"""The base's objects that lane 1 has a copy of, named <name>-lane1."""


def lane_of(obj: dict[str, Any]) -> int | None:
    """The lane an object's pods (or the object) belong to, by its label."""
    labels = obj["metadata"].get("labels", {})
    return int(labels[LANE_LABEL]) if LANE_LABEL in labels else None


def test_lanes_overlay_is_the_base_plus_lane1s_redis_services_and_scaled_objects() -> None:
    base = {(o["kind"], o["metadata"]["name"]) for o in rendered("base") if o["kind"] != "ConfigMap"}
    lanes = {(o["kind"], o["metadata"]["name"]) for o in rendered("lanes") if o["kind"] != "ConfigMap"}
    copies = {(kind, f"{name}-lane1") for kind, name in (item.split("/") for item in LANE1)}
    assert lanes - base == copies
    assert base <= lanes, "one learner and one runs volume for every lane"
    objects = rendered("lanes")
    recipe_configmap(objects)  # one recipe, the overlay's
    for kind, name in copies:
        assert lane_of(find(objects, kind, name)) == 1, f"{kind}/{name}"
    assert lanes_count(objects) == 2


def test_lanes_recipe_is_the_base_recipe_plus_its_lanes() -> None:
    objects = rendered("lanes")
    recipe = read_recipe_text(recipe_configmap(objects)["data"]["recipe.toml"])
    assert recipe == read_recipe(OVERLAYS["lanes"] / "recipe.toml")
    lanes = recipe.pop("lanes")
    assert recipe == read_recipe(K8S / "base" / "recipe.toml"), "keep overlays/lanes/recipe.toml the base's + [lanes]"
    assert lanes["count"] == 2 and len(lanes["urls"]) == 2
    # each URL (in lane order) names the Service of that lane's Redis, which selects that Redis' pods only
    for lane, url in enumerate(lanes["urls"]):
        parts = urlsplit(url)
        assert parts.username is None and parts.password is None, "no password in a ConfigMap"
        service = find(objects, "Service", parts.hostname or "")
        (port,) = service["spec"]["ports"]
        assert port["port"] == parts.port == 6379
        selected = [o for o in workloads(objects) if selects(service["spec"]["selector"], o)]
        assert [(o["metadata"]["name"], lane_of(o)) for o in selected] == [(service["metadata"]["name"], lane)]
        assert pod_spec(selected[0])["containers"][0]["image"].startswith("redis:")
    assert lanes["urls"][0] == "redis://redis:6379/0", "lane 0's Redis is the home's (redis.url)"


def selects(selector: dict[str, str], obj: dict[str, Any]) -> bool:
    return selector.items() <= obj["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_selector_picks_its_own_pods_only(overlay: str) -> None:
    objects = rendered(overlay)
    for obj in workloads(objects):
        picked = [
            o["metadata"]["name"] for o in workloads(objects) if selects(obj["spec"]["selector"]["matchLabels"], o)
        ]
        assert picked == [obj["metadata"]["name"]], f"{obj['kind']}/{obj['metadata']['name']} selects {picked}"
    for service in (o for o in objects if o["kind"] == "Service"):
        picked = [o["metadata"]["name"] for o in workloads(objects) if selects(service["spec"]["selector"], o)]
        assert picked == [service["metadata"]["name"]], f"Service/{service['metadata']['name']} selects {picked}"


def lane_workloads(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str, int | None]]:
    """(workload, service, lane) of every streamrl service's workload."""
    return [(obj, service, lane_of(obj)) for obj, service in service_workloads(objects)]


def test_every_pod_of_a_lane_service_has_its_lane_and_the_learner_none() -> None:
    objects = rendered("lanes")
    found = set()
    for obj, service, lane in lane_workloads(objects):
        name = obj["metadata"]["name"]
        env = {e["name"]: e for e in container(objects, service, name)["env"]}
        if service == "learner":
            assert lane is None and "STREAMRL_LANE" not in env, "the learner serves every lane"
            continue
        # a lane service without STREAMRL_LANE refuses to start (streamrl.common.lanes.check_lane)
        assert env["STREAMRL_LANE"] == {"name": "STREAMRL_LANE", "value": str(lane)}, name
        assert lane_of({"metadata": obj["spec"]["template"]["metadata"]}) == lane, name
        assert name == (service if lane == 0 else f"{service}-lane{lane}")
        found.add((service, lane))
    assert found == {(service, lane) for service in LANE_SERVICES for lane in range(lanes_count(objects))}
    assert sum(service == "learner" for _, service, _ in lane_workloads(objects)) == 1


@pytest.mark.parametrize("lane", [0, 1])
@pytest.mark.parametrize("service", LANE_SERVICES)
def test_lane_service_config_loads_with_its_lane_and_every_lanes_redis(
    service: str, lane: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = service if lane == 0 else f"{service}-lane{lane}"
    config, env, secrets = load_service_config("lanes", service, tmp_path, monkeypatch, name=name)
    assert config.lane == lane and config.lanes.count == 2
    assert check_lane(service, config.lane, config.lanes) is None
    redis_secret = secrets["streamrl-redis"]
    assert config.redis.url == redis_secret[f"url-{service}"], "redis.url: the home's"
    assert config.lanes.urls == [redis_secret[f"url-{service}"], redis_secret[f"url-{service}-lane1"]]
    assert_lane_urls(config, service)
    # its own lane's Redis, and its own lane's keys (lifecycle.where)
    url = urlsplit(config.lanes.url(lane, config.redis.url))
    assert url.hostname == ("redis" if lane == 0 else f"redis-lane{lane}")
    assert names_of(config).prompts == f"streamrl:{{{config.run_id}/lane{lane}}}:prompts"
    # without STREAMRL_LANE the same pod would refuse to start
    monkeypatch.delenv("STREAMRL_LANE")
    recipe = Path(os.environ["STREAMRL_RECIPE"])
    unset = load_config(CONFIG_CLASSES[service], recipe, section=service)
    assert unset.lane is None
    assert "STREAMRL_LANE" in (check_lane(service, unset.lane, unset.lanes) or "")
    assert env["STREAMRL_INSTANCE"] == f"{name}-0"


def assert_lane_urls(config: ServiceConfig, service: str) -> None:
    """Each of ``config``'s lane URLs is the recipe's for that lane, logged in as the service's own user."""
    recipe = read_recipe_text(recipe_configmap(rendered("lanes"))["data"]["recipe.toml"])
    for given, url in zip(recipe["lanes"]["urls"], config.lanes.urls, strict=True):
        parts, expected = urlsplit(url), urlsplit(given)
        assert (parts.hostname, parts.port, parts.path) == (expected.hostname, expected.port, expected.path)
        assert parts.username == service and parts.password


def test_the_learner_of_the_lanes_overlay_serves_no_lane_and_reaches_every_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _, secrets = load_service_config("lanes", "learner", tmp_path, monkeypatch)
    assert config.lane is None and config.lanes.count == 2
    assert check_lane("learner", config.lane, config.lanes) is None
    assert config.redis.url == secrets["streamrl-redis"]["url-learner"]
    assert_lane_urls(config, "learner")


@pytest.mark.parametrize("lane", [0, 1])
@pytest.mark.parametrize("service", SCALED)
def test_each_lanes_scaled_objects_read_its_streams_on_its_redis(
    service: str, lane: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = rendered("lanes")
    name = service if lane == 0 else f"{service}-lane{lane}"
    scaled = find(objects, "ScaledObject", name)["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    (trigger,) = scaled["triggers"]
    stream, group = SCALED[service]
    meta = trigger["metadata"]
    assert meta["stream"] == getattr(lane_names(run_id(objects), lane), stream)
    assert meta["consumerGroup"] == group
    config, _, _ = load_service_config("lanes", service, tmp_path, monkeypatch, name=name)
    assert meta["stream"] == getattr(names_of(config), stream), "what the lane's replicas consume"
    assert 0 < int(meta["pendingEntriesCount"]) < config.consumer.max_in_flight
    # KEDA logs in as the observer to the lane's Redis Service, in the namespace
    auth = find(objects, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    redis_secret = default_secrets(2)["streamrl-redis"]
    address = redis_secret[refs["address"]["key"]]
    redis_service = urlsplit(config.lanes.url(lane, config.redis.url)).hostname
    assert address == f"{redis_service}.{NAMESPACE}.svc:6379"
    assert lane_of(find(objects, "Service", redis_service or "")) == lane
    assert redis_secret[refs["username"]["key"]] == "observer"
    assert refs["password"]["key"] == "password-observer"


def test_every_redis_of_the_lanes_overlay_renders_the_acl_of_every_lane(tmp_path: Path) -> None:
    objects = rendered("lanes")
    redises = [o for o in workloads(objects) if o["metadata"]["labels"]["app.kubernetes.io/name"] == "redis"]
    assert sorted(lane_of(o) for o in redises) == [0, 1]
    files = set()
    for obj in redises:
        name = obj["metadata"]["name"]
        (init,) = pod_spec(obj)["initContainers"]
        assert init["args"][init["args"].index("--lanes") + 1] == str(lanes_count(objects)), name
        passwords = render_acl("lanes", name, tmp_path / f"{name}.acl")
        text = (tmp_path / f"{name}.acl").read_text()
        assert text == acl_file(run_id(objects), passwords, lanes=2), name
        files.add(text)
    assert len(files) == 1, "one ACL file serves every lane's Redis"


@pytest.fixture(scope="module")
def lanes_acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, dict[str, str]]]:
    """redis-server with the ACL file lane 1's Redis renders in overlays/lanes."""
    folder = tmp_path_factory.mktemp("k8s-lanes-acl")
    passwords = render_acl("lanes", "redis-lane1", folder / "users.acl")
    with serve_acl(folder, passwords) as port:
        yield port, passwords


@pytest.mark.parametrize("service", SCALED)
def test_kedas_login_may_read_what_lane1s_trigger_reads(
    service: str, lanes_acl_redis: tuple[int, dict[str, str]]
) -> None:
    port, passwords = lanes_acl_redis
    meta = find(rendered("lanes"), "ScaledObject", f"{service}-lane1")["spec"]["triggers"][0]["metadata"]
    consumer = redis.Redis(port=port, username=service, password=passwords[service], socket_timeout=5)
    try:
        consumer.xgroup_create(meta["stream"], meta["consumerGroup"], id="0", mkstream=True)
    except redis.ResponseError as e:
        assert "BUSYGROUP" in str(e)
    observer = redis.Redis(port=port, username="observer", password=passwords["observer"], socket_timeout=5)
    assert observer.xpending(meta["stream"], meta["consumerGroup"])["pending"] == 0


def test_make_secrets_writes_each_lanes_urls_and_kedas_address() -> None:
    secrets = make_secrets("team-a", lanes=3)["streamrl-redis"]
    for lane in (1, 2):
        for service in SERVICES:
            password = secrets[f"password-{service}"]
            assert secrets[f"url-{service}-lane{lane}"] == f"redis://{service}:{password}@redis-lane{lane}:6379/0"
        assert secrets[f"keda-address-lane{lane}"] == f"redis-lane{lane}.team-a.svc:6379"
    assert not any("lane3" in key for key in secrets)
    assert not any("lane" in key for key in make_secrets("team-a")["streamrl-redis"])
    result = subprocess.run([str(K8S / "make-secrets.sh"), "team-a", "two"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "LANES" in result.stderr
