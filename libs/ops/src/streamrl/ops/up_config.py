"""The ``[up]`` section of a recipe: which services ``streamrl up`` starts, how many, where, and how
it restarts and scales them, on either backend (local processes or Ray actors).

Pydantic only (no Ray import): a recipe is validated before any backend is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from streamrl.common.config import BaseConfig
from streamrl.common.lanes import LanesConfig
from streamrl.ops.autoscale import AutoscaleConfig

SERVICES = ("coordinator", "rollout", "reward", "learner")
SCALABLE = ("rollout", "reward")
"""Services whose replica count can change while a run is live (they share their stream's consumer group)."""


class ServiceResources(BaseConfig):
    """What one replica of a service asks the Ray scheduler for (``[up] backend = "ray"``)."""

    num_cpus: float = Field(1.0, ge=0)
    """Logical CPUs reserved for the replica's actor (fractions allowed)."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs reserved for the replica's actor; a fraction below 1 shares one GPU with other actors (colocation,
    e.g. ``0.5`` for a rollout and a learner on one device). Above 1 it must be whole. The service process sees
    exactly the GPUs Ray assigned (``CUDA_VISIBLE_DEVICES``); with 0 it sees none."""

    @field_validator("num_gpus")
    @classmethod
    def _whole_above_one(cls, value: float) -> float:
        if value > 1 and not float(value).is_integer():
            raise ValueError(f"{value} is neither a fraction of one GPU nor a whole number of GPUs")
        return value


class RedisMemoryConfig(BaseConfig):
    """``[up.redis_memory]``: the Redis memory bound of the run (:mod:`streamrl.ops.memory_budget`,
    docs/operations.md) and what ``streamrl up`` does with it: ``maxmemory`` of the embedded redis-server,
    or a warning about an external one. The assumption fields describe the run's data and speed."""

    maxmemory_mb: float | None = Field(None, ge=0)
    """``maxmemory`` of the embedded redis-server (MiB). None: the run's bound times ``margin`` (at least
    64 MiB); 0: no limit. Its policy is always ``noeviction``. With lanes (one embedded server per lane) this is
    the run's total: each server gets an even share (at least 64 MiB)."""
    margin: float = Field(2.0, ge=1)
    """maxmemory = bound x margin (the bound is a worst case; the margin covers what it does not model:
    tools reading the streams, a client's buffers)."""
    text_bytes_per_token: float = Field(6.0, gt=0)
    """Bytes of prompt and response text per token (UTF-8; BPE tokenizers average ~4 on English)."""
    row_bytes: int = Field(1024, ge=0)
    """Bytes of a dataset row's label and other fields, which travel with every sample as metadata."""
    image_bytes: int = Field(0, ge=0)
    """Bytes of the images of one prompt (vision-language runs; 0: none)."""
    min_step_s: float = Field(0.25, gt=0)
    """The shortest learner step expected (s): consumed entries waiting to be trimmed are this many
    steps' worth."""
    dead_letters: int = Field(256, ge=0)
    """Sample-sized dead letters the ``dead`` stream is assumed to keep."""
    dead_batches: int = Field(2, ge=0)
    """Batch-sized dead letters (batches the learner skipped) assumed kept."""

    def assumptions(self) -> dict[str, float | int]:
        """The fields :class:`streamrl.ops.memory_budget.RunShape` takes as assumptions."""
        return self.model_dump(exclude={"maxmemory_mb", "margin"})


class UpConfig(BaseConfig):
    """The ``[up]`` section: what ``streamrl up`` starts and how it keeps it running."""

    services: list[str] = list(SERVICES)
    """Services to start, in order."""
    replicas: dict[str, int] = {}
    """Instances per service at start (default 1), e.g. ``{reward = 2}``. Rollout and reward can be changed while
    the run is live with ``streamrl scale``. With lanes (``lanes.count > 1``) the counts of rollout and reward are
    per lane, and so is the coordinator's (one active per lane; more stand by)."""
    threads: dict[str, PositiveInt] = {}
    """CPU threads per service (its ``OMP_NUM_THREADS``), e.g. ``{learner = 2, rollout = 1}``; default:
    inherited from the environment."""
    until: str = "coordinator"
    """The run is over when this service exits 0."""
    grace_s: float = Field(20.0, ge=0)
    """On stop, and when a replica is removed by scaling, time it gets after SIGTERM before SIGKILL (s)."""
    display: bool = True
    """Show the live progress display (a line every few seconds when not a terminal)."""
    display_interval_s: float = Field(2.0, gt=0)
    """How often the progress display is redrawn (s)."""
    gpus: dict[str, str | list[str]] = {}
    """Local backend: GPU placement, service -> the ``CUDA_VISIBLE_DEVICES`` of its processes. A string applies to
    every replica, a list gives one entry per replica (as many as ``replicas``; a replica added by scaling beyond
    the list takes entry ``index % len``). A service without an entry inherits the launcher's environment. E.g.
    ``{rollout = ["0", "1"], learner = "2"}``; the colocated mode is rollout and learner on one device:
    ``{rollout = "0", learner = "0"}``. The Ray backend places GPUs with ``resources`` instead."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """Memory of each GPU in ``gpus`` (GiB) for the memory plan (:mod:`streamrl.ops.gpu_plan`), which ``streamrl up``
    prints before loading anything and which refuses a run that cannot fit; None = what ``nvidia-smi`` reports
    (no GPU: no plan)."""
    gpu_memory_margin_gib: float = Field(1.0, ge=0)
    """Memory the plan keeps free on each GPU (GiB): its terms are estimates."""
    gpu_plan_check: bool = True
    """Refuse to start a run whose memory plan does not fit (false: print the plan and start anyway)."""
    max_restarts: dict[str, int] = {}
    """Restarts allowed per replica over the whole run, by service, e.g. ``{learner = 10}``; a service not named
    has no such bound (only ``crash_loop_limit`` ends its restarts); 0: its first crash stops the run. A crash is
    an exit that is not asked for: non-zero, or any exit but the ``until`` service's exit 0. An exit code 2 (the
    service refuses its configuration) is never restarted. A restarted replica gets a new instance name
    (``rollout-1.1``). Ray backend: the actor's ``max_restarts`` (Ray restarts it), default
    ``crash_loop_limit - 1``."""
    crash_loop_limit: int = Field(5, ge=1)
    """A replica that crashes this many times within ``crash_loop_window_s`` is crash-looping: the run stops,
    naming it and showing its last lines of output. 1: no restarts (the first crash stops the run)."""
    crash_loop_window_s: float = Field(600.0, gt=0)
    """The window of ``crash_loop_limit`` (s): crashes older than this are forgotten, so a replica that crashes
    now and then, recovering each time, keeps being restarted."""
    restart_backoff_s: float = Field(1.0, ge=0)
    """Local backend: wait before restarting a crashed replica (s); it doubles with each further crash of that
    replica within ``crash_loop_window_s``, up to ``restart_backoff_max_s``."""
    restart_backoff_max_s: float = Field(30.0, ge=0)
    """Local backend: the longest wait before a restart (s)."""
    reconcile_interval_s: float = Field(1.0, gt=0)
    """How often the launcher reads the run's desired replica counts (``streamrl scale``) and starts or drains
    replicas to match (s)."""
    max_replicas: dict[str, int] = {}
    """Upper bound per scalable service on what ``streamrl scale`` may request, e.g. ``{rollout = 8}``; default:
    no bound."""
    backend: Literal["local", "ray"] = "local"
    """``local``: every replica a child process of the launcher on this machine. ``ray``: every replica a Ray actor
    running the service as its child process (``pip install 'streamrl-ops[ray]'``)."""
    ray_address: str | None = None
    """Ray backend: None starts a local Ray on this machine; ``auto`` joins the cluster this machine belongs to;
    ``ray://host:10001`` connects as a Ray client. The recipe and data paths must exist on every node."""
    ray_num_cpus: int | None = Field(None, ge=1)
    """Ray backend, local Ray only: logical CPUs it offers (None = this machine's count)."""
    ray_object_store_mb: int = Field(128, ge=80)
    """Ray backend, local Ray only: its object store (MiB). streamrl moves no data through it (the data rides on
    Redis and the weights on their own transport), so it stays small."""
    redis_appendfsync: Literal["everysec", "always"] = "everysec"
    """When the embedded redis-server's AOF reaches the disk. ``everysec``: once a second; whatever Redis
    acknowledged survives a crash of Redis or of any process, but a power loss or a kernel crash loses up to
    the last second of writes. ``always``: before every reply; nothing acknowledged is lost even then, at a cost
    (docs/operations.md: measured 248 vs 13,605 one-client XADDs per s on a virtual disk)."""
    redis_memory: RedisMemoryConfig = RedisMemoryConfig()
    """The run's Redis memory bound: ``maxmemory`` of the embedded redis-server, the check of an external one."""
    resources: dict[str, ServiceResources] = {}
    """Ray backend: per-service resources of each replica, e.g. ``{rollout = {num_cpus = 1, num_gpus = 0.5},
    learner = {num_gpus = 1}}``; default ``num_cpus = 1, num_gpus = 0``. The learner with ``learner.ranks = N``
    reserves N times its entry (one actor runs the learner, which starts its N ranks)."""

    @model_validator(mode="after")
    def _check_services(self) -> UpConfig:
        for field in ("replicas", "threads", "gpus", "max_restarts", "resources"):
            for service in getattr(self, field):
                if service not in SERVICES:
                    raise ValueError(f"up.{field}.{service}: unknown service; known: {list(SERVICES)}")
        for service in self.max_replicas:
            if service not in SCALABLE:
                raise ValueError(f"up.max_replicas.{service}: only {list(SCALABLE)} can be scaled")
        return self

    @model_validator(mode="after")
    def _check_counts(self) -> UpConfig:
        for field in ("replicas", "max_restarts"):
            for service, count in getattr(self, field).items():
                if count < 0:
                    raise ValueError(f"up.{field}.{service}: {count} < 0")
        for service, bound in self.max_replicas.items():
            if self.replicas.get(service, 1) > bound:
                raise ValueError(
                    f"up.max_replicas.{service}: {bound} is below up.replicas.{service} = {self.replicas[service]}"
                )
        return self

    @model_validator(mode="after")
    def _check_gpus(self) -> UpConfig:
        for service, devices in self.gpus.items():
            replicas = self.replicas.get(service, 1)
            if isinstance(devices, list) and len(devices) != replicas:
                raise ValueError(
                    f"up.gpus.{service}: {len(devices)} entries for {replicas} replica(s); give one per replica "
                    "or a single string for all"
                )
        if self.backend == "ray" and self.gpus:
            raise ValueError("up.gpus: the ray backend places GPUs by up.resources (num_gpus per replica)")
        return self

    def cuda_devices(self, service: str, replica: int) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` of replica ``replica`` of ``service`` (None = inherited)."""
        devices = self.gpus.get(service)
        return devices[replica % len(devices)] if isinstance(devices, list) else devices

    def resources_of(self, service: str) -> ServiceResources:
        """Resources of one replica of ``service`` on the Ray backend."""
        return self.resources.get(service, ServiceResources())


def colocated_sleep_problem(recipe: Mapping[str, Any]) -> str | None:
    """Why a recipe may not set ``rollout.engine.sleep_between_versions`` (None: it may, or does not).

    The engine gives its GPU memory back while the learner trains only in colocated synchronous
    runs: every prompt of a version is answered before the learner trains on them
    (``coordinator.max_staleness = 0``) and the weights stay on the shared GPU
    (``learner.weights_transport = "ipc"``). Reads the raw sections (each service validates its own).
    """

    def section(name: str) -> Mapping[str, Any]:
        value = recipe.get(name)
        return value if isinstance(value, Mapping) else {}

    engine = section("rollout").get("engine")
    if not (isinstance(engine, Mapping) and engine.get("sleep_between_versions") is True):
        return None
    staleness = section("coordinator").get("max_staleness", 0)
    if staleness != 0:
        return (
            "rollout.engine.sleep_between_versions is for synchronous runs: it needs coordinator.max_staleness = 0, "
            f"it is {staleness} (the engine would sleep while prompts of the current version are still owed)"
        )
    transport = section("learner").get("weights_transport", "zmq")
    if transport != "ipc":
        return (
            "rollout.engine.sleep_between_versions is for a rollout engine on the learner's GPU: it needs "
            f"learner.weights_transport = 'ipc' (colocated), it is {transport!r}"
        )
    return None


LORA_DEFAULT_RANK = 16
"""``learner.lora.rank`` when a recipe does not set it (the learner's LoraConfig default)."""


def lora_engine_problem(recipe: Mapping[str, Any]) -> str | None:
    """Why a recipe's rollout engine cannot serve its learner's LoRA adapters (None: it can, or there are none).

    With ``learner.lora`` and ``sync = "adapter"`` (its default) every version is an adapter: the engine
    needs ``rollout.engine.max_lora_rank`` at or above ``learner.lora.rank``. Reads the raw sections.
    """
    learner = recipe.get("learner")
    lora = learner.get("lora") if isinstance(learner, Mapping) else None
    if not isinstance(lora, Mapping) or lora.get("sync", "adapter") != "adapter":
        return None
    rollout = recipe.get("rollout")
    engine = rollout.get("engine") if isinstance(rollout, Mapping) else None
    max_rank = engine.get("max_lora_rank") if isinstance(engine, Mapping) else None
    rank = lora.get("rank", LORA_DEFAULT_RANK)
    if max_rank is None:
        return (
            f"learner.lora (sync = 'adapter') publishes LoRA adapters of rank {rank}: set rollout.engine.max_lora_rank "
            "(vLLM: one of 1, 8, 16, 32, 64, ...) or learner.lora.sync = 'merged'"
        )
    if isinstance(rank, int) and isinstance(max_rank, int) and rank > max_rank:
        return f"learner.lora.rank = {rank} is above rollout.engine.max_lora_rank = {max_rank}: raise max_lora_rank"
    return None


class LaunchRecipe(BaseConfig):
    """Top level of a recipe as the launcher sees it (service sections are validated by each service)."""

    model_config = BaseConfig.model_config | {"extra": "allow"}
    run_id: str = "default"
    run_dir: str = "runs/default"
    up: UpConfig = UpConfig()
    autoscale: AutoscaleConfig = AutoscaleConfig()
    """Replica counts of rollout and reward from their backlog (:mod:`streamrl.ops.autoscale`)."""
    lanes: LanesConfig = LanesConfig()
    """The run's lanes (:mod:`streamrl.common.lanes`): the launcher places a coordinator, rollout and reward
    replicas per lane (:mod:`streamrl.ops.lane_plan`)."""

    @model_validator(mode="after")
    def _check_lanes(self) -> LaunchRecipe:
        if self.lanes.enabled and self.autoscale.enabled:
            raise ValueError(
                f"autoscale.enabled with lanes.count = {self.lanes.count}: the autoscaler reads the home's backlogs, "
                "which lanes do not fill; scale each lane's rollout and reward with up.replicas / streamrl scale "
                "(counts per lane) instead"
            )
        return self

    @model_validator(mode="after")
    def _check_colocated_sleep(self) -> LaunchRecipe:
        problem = colocated_sleep_problem(self.model_extra or {})
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_lora_engine(self) -> LaunchRecipe:
        problem = lora_engine_problem(self.model_extra or {})
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_autoscale(self) -> LaunchRecipe:
        if not self.autoscale.enabled:
            return self
        for service, policy in self.autoscale.services.items():
            if service not in self.up.services:
                raise ValueError(f"autoscale.services.{service}: the service is not in up.services")
            bound = self.up.max_replicas.get(service)
            if bound is not None and policy.max_replicas > bound:
                raise ValueError(
                    f"autoscale.services.{service}.max_replicas ({policy.max_replicas}) is above "
                    f"up.max_replicas.{service} ({bound})"
                )
        return self
