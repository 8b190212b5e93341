"""The Ray backend of ``streamrl up`` (``[up] backend = "ray"``): every service replica a Ray actor.

* Placement: each replica's actor asks for ``[up] resources.<service>`` (CPUs, whole or fractional
  GPUs). The learner with ``learner.ranks = N`` is one actor reserving N times its entry: an actor
  lives on one node, so its GPUs are packed on one node (what a STRICT_PACK placement group of N
  bundles would give), and the learner starts its N ranks on them itself. (Ranks as separate
  actors spread over nodes, in a placement group, would need the learner group to join ranks
  started elsewhere; not done.) With lanes the placement is the local backend's: one coordinator actor per
  lane and ``up.replicas`` rollout and reward actors per lane, each with ``STREAMRL_LANE`` (units of
  :mod:`streamrl.ops.lane_plan`, named ``rollout-lane1-0``), and one learner.
* The actor (:class:`ServiceActor`) runs the service as its child process - the same command and
  environment as the local backend (its service's Redis URL, the weights key, ``OMP_NUM_THREADS``) with
  ``CUDA_VISIBLE_DEVICES`` = the GPUs Ray assigned it (none when it asked for none). The child gets
  SIGTERM if the actor dies (``PR_SET_PDEATHSIG``). Its output goes to the actor's stdout, which Ray
  forwards to the driver prefixed by the instance name.
* Restarts: when its child crashes the actor exits abnormally, and Ray restarts it while
  ``[up] max_restarts.<service>`` allows (default ``crash_loop_limit - 1`` over the run: Ray restarts
  without the local backend's window); each incarnation counts itself in the run's
  ``state("incarnations")`` hash and takes a new instance name (``rollout-1.1``), so no consumer name
  is shared by two live processes. A driver call waiting on a restarting actor is retried on the
  new incarnation; one whose actor is dead for good fails, and the launcher stops the run.
* Scaling and stop: the actor's :meth:`ServiceActor.stop` SIGTERMs its child (the service drains),
  waits ``grace_s``, SIGKILLs it; then the driver kills the actor.

Ray is imported here only, and only once this backend is chosen. With ``ray_address`` unset a local
Ray is started (logical CPUs ``ray_num_cpus``, a small object store, no dashboard); otherwise the
driver joins that cluster, whose nodes must have streamrl installed, the recipe's paths, and a route
to ``redis.url``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis as syncredis

from streamrl.common.streams import StreamNames
from streamrl.ops.lane_plan import split_unit, unit_env
from streamrl.ops.replicas import Ended, Say, child_env, die_with_parent, service_command, signal_group
from streamrl.ops.scaling import instance_name
from streamrl.ops.up_config import ServiceResources, UpConfig

ACTOR_CONCURRENCY = 4
"""Threads of a replica's actor: its ``wait`` call and a ``stop`` (or ``name``) must run side by side."""
KILL_MARGIN_S = 10.0
"""After ``grace_s`` of a removal, how long the driver still waits for the actor's answer before killing it (s)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What one replica's actor needs to start its service (sent to the actor by Ray)."""

    service: str
    index: int
    run_id: str
    recipe: str
    overrides: list[str]
    env: dict[str, str]
    """Set in the service's environment over the node's own (STREAMRL_* of the driver: Redis URL, weights key)."""
    threads: int | None
    num_gpus: float
    until: bool
    """This service ending with exit code 0 ends the run (the actor then stays, without restart)."""
    cwd: str
    """Working directory of the service (relative paths of the recipe), when it exists on the node."""
    unit: str = ""
    """Its unit when it serves a lane (``rollout-lane1``, :mod:`streamrl.ops.lane_plan`): its names' prefix."""
    launcher_url: str = ""
    """The Redis URL the actor counts its incarnation with (the launcher's login of an embedded Redis, whose
    service users may not); empty: the service's own."""


def incarnations_key(names: StreamNames) -> str:
    """Hash ``{service}-{index}`` -> how many actors of that replica have started in this launch."""
    return names.state("incarnations")


def next_incarnation(client: syncredis.Redis, names: StreamNames, service: str, index: int) -> int:
    """0 for the first actor of a replica, then 1, 2, ... for each restart or re-creation."""
    return int(client.hincrby(incarnations_key(names), f"{service}-{index}", 1)) - 1


def visible_devices(num_gpus: float, assigned: list[Any]) -> str:
    """``CUDA_VISIBLE_DEVICES`` of a service: the GPUs Ray assigned its actor; empty (none) when it asked for none."""
    return ",".join(str(g) for g in assigned) if num_gpus > 0 else ""


def actor_options(service: str, resources: ServiceResources, max_restarts: int, learner_ranks: int) -> dict[str, Any]:
    """Ray actor options of one replica of ``service``."""
    scale = learner_ranks if service == "learner" else 1
    return {
        "num_cpus": resources.num_cpus * scale,
        "num_gpus": resources.num_gpus * scale,
        "max_restarts": max_restarts,
        "max_task_retries": -1,  # a call in flight when the actor restarts runs again on the new one
        "max_concurrency": ACTOR_CONCURRENCY,
    }


class ServiceActor:
    """One replica on Ray: runs its service as a child process and lives as long as that child.

    Plain class; :class:`RayReplicas` turns it into an actor with ``ray.remote(...)``.
    """

    def __init__(self, spec: ReplicaSpec) -> None:
        import ray

        self.spec = spec
        client = syncredis.Redis.from_url(spec.launcher_url or spec.env["STREAMRL_REDIS__URL"], socket_timeout=10)
        try:
            incarnation = next_incarnation(client, StreamNames(spec.run_id), spec.unit or spec.service, spec.index)
        finally:
            client.close()
        self.name = instance_name(spec.unit or spec.service, spec.index, incarnation)
        gpus = visible_devices(spec.num_gpus, ray.get_gpu_ids())
        env = child_env({**os.environ, **spec.env}, self.name, spec.threads, gpus)
        cmd = service_command(sys.executable, spec.service, spec.recipe, spec.overrides, self.name)
        self.stopping = False
        self.code: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        # the child is started by the thread that waits for it: PR_SET_PDEATHSIG fires when the starting
        # thread ends, so it must live exactly as long as the child (or the actor process)
        threading.Thread(target=self._run, args=(cmd, env), daemon=True).start()
        self._started.wait()
        if self.proc is None:
            raise RuntimeError(f"{self.name}: could not start {cmd[1:4]}")
        print(
            f"started {self.name} (pid {self.proc.pid}, actor pid {os.getpid()}; CUDA_VISIBLE_DEVICES={gpus!r})",
            flush=True,
        )

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with it
        return getattr(self, "name", "streamrl-replica")

    def _run(self, cmd: list[str], env: dict[str, str]) -> None:
        cwd = self.spec.cwd if os.path.isdir(self.spec.cwd) else None
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd, preexec_fn=die_with_parent
            )
        finally:
            self._started.set()
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            print(raw.decode(errors="replace").rstrip(), flush=True)
        self.code = self.proc.wait()
        self._done.set()
        if self.stopping or (self.code == 0 and self.spec.until):
            return
        print(f"{self.name} exited with code {self.code}: its actor exits for Ray to restart it", flush=True)
        sys.stdout.flush()
        os._exit(1)  # abnormal actor exit: Ray's restart policy applies (max_restarts)

    def wait(self) -> int | None:
        """Block until the service ends by itself (the ``until`` service's exit 0) or is stopped; its exit code."""
        self._done.wait()
        return self.code

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the service (it drains), SIGKILL it after ``grace_s``; its exit code."""
        self.stopping = True
        if self.proc is None:
            return None
        signal_group(self.proc, signal.SIGTERM)
        if not self._done.wait(grace_s):
            print(f"{self.name} did not stop within {grace_s} s: killing it", flush=True)
            signal_group(self.proc, signal.SIGKILL)
            self._done.wait(KILL_MARGIN_S)
        return self.code

    def instance(self) -> str:
        return self.name


@dataclass
class RayReplica:
    service: str
    index: int
    actor: Any
    """The actor handle."""
    waiting: Any
    """ObjectRef of the actor's ``wait()``."""
    kill_at: float | None = None
    """Set once it is being drained: when the driver kills the actor if it has not answered."""
    stopping: list[Any] = field(default_factory=list)
    """ObjectRef of the actor's ``stop()`` while draining."""

    @property
    def name(self) -> str:
        return f"{self.service}-{self.index}"


class RayReplicas:
    """The launcher's replicas as Ray actors (the :class:`streamrl.ops.replicas.Replicas` of ``backend = "ray"``)."""

    def __init__(
        self,
        up: UpConfig,
        run_id: str,
        recipe: str,
        overrides: list[str],
        env: Mapping[str, str],
        learner_ranks: int,
        say: Say,
        service_env: Mapping[str, Mapping[str, str]] | None = None,
        launcher_url: str = "",
    ) -> None:
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # one line per replica, not "[repeated 3x across cluster]"
        import ray

        self.ray = ray
        self.up = up
        self.run_id = run_id
        self.recipe = os.path.abspath(recipe)
        self.overrides = overrides
        self.env = {k: v for k, v in env.items() if k.startswith("STREAMRL_")}
        self.service_env = {s: dict(e) for s, e in (service_env or {}).items()}
        """Set over :attr:`env` for the replicas of one service (its own Redis login)."""
        self.launcher_url = launcher_url
        self.learner_ranks = learner_ranks
        self.say = say
        self.replicas: dict[tuple[str, int], RayReplica] = {}
        client = syncredis.Redis.from_url(launcher_url or self.env["STREAMRL_REDIS__URL"], socket_timeout=10)
        try:
            client.delete(incarnations_key(StreamNames(run_id)))  # first actors of this launch: rollout-0, ...
        finally:
            client.close()
        if up.ray_address is None:
            ray.init(
                num_cpus=up.ray_num_cpus,
                include_dashboard=False,
                log_to_driver=True,
                object_store_memory=up.ray_object_store_mb * 2**20,
            )
            where = "a local Ray"
        else:
            ray.init(address=up.ray_address, log_to_driver=True)
            where = f"the Ray cluster at {up.ray_address}"
        total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        say(f"ray: running on {where} (resources {total})")
        self.remote_actor: Any = ray.remote(ServiceActor)  # an actor class: Ray types its .options/.remote loosely

    def start(self, unit: str, index: int) -> None:
        service = split_unit(unit)[0]
        resources = self.up.resources_of(service)
        restarts = self.up.max_restarts.get(service, self.up.crash_loop_limit - 1)
        options = actor_options(service, resources, restarts, self.learner_ranks)
        spec = ReplicaSpec(
            service=service,
            index=index,
            run_id=self.run_id,
            recipe=self.recipe,
            overrides=self.overrides,
            env={**self.env, **self.service_env.get(service, {}), **unit_env(unit)},
            threads=self.up.threads.get(service),
            num_gpus=options["num_gpus"],
            until=service == self.up.until,
            cwd=os.getcwd(),
            unit=unit if unit != service else "",
            launcher_url=self.launcher_url,
        )
        actor = self.remote_actor.options(**options).remote(spec)
        self.replicas[(unit, index)] = RayReplica(unit, index, actor, actor.wait.remote())
        shown = {k: options[k] for k in ("num_cpus", "num_gpus", "max_restarts")}
        self.say(f"placing {unit}-{index} as a Ray actor {shown}")

    def drain(self, service: str, index: int) -> None:
        replica = self.replicas.get((service, index))
        if replica is None or replica.kill_at is not None:
            return
        replica.kill_at = time.monotonic() + self.up.grace_s + KILL_MARGIN_S
        replica.stopping.append(replica.actor.stop.remote(self.up.grace_s))
        self.say(f"draining {replica.name} (scaled down)")

    def poll(self) -> list[Ended]:
        ray = self.ray
        if not self.replicas:
            return []
        refs = [r.waiting for r in self.replicas.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = {ref.hex() for ref in ready}
        ended: list[Ended] = []
        now = time.monotonic()
        for key, replica in list(self.replicas.items()):
            if replica.waiting.hex() not in done:
                if replica.kill_at is not None and now >= replica.kill_at:
                    self.say(f"{replica.name} did not answer its stop in time: killing its actor", error=True)
                    ray.kill(replica.actor, no_restart=True)
                    replica.kill_at = float("inf")
                continue
            code, detail = self._outcome(replica.waiting)
            del self.replicas[key]
            if replica.kill_at is not None or (code == 0 and split_unit(replica.service)[0] == self.up.until):
                ray.kill(replica.actor, no_restart=True)
                ended.append(
                    Ended(
                        replica.service,
                        replica.index,
                        replica.name,
                        code,
                        removed=replica.kill_at is not None,
                        detail=detail,
                    )
                )
            else:
                ended.append(Ended(replica.service, replica.index, replica.name, code, removed=False, detail=detail))
        return ended

    def _outcome(self, ref: Any) -> tuple[int | None, str]:
        """The exit code a finished ``wait()`` returned, or why there is none (its actor died for good)."""
        try:
            return self.ray.get(ref), ""
        except self.ray.exceptions.RayActorError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return None, f"its actor died with no restart left: {first}"

    def active(self, service: str) -> list[int]:
        return [i for (s, i), r in self.replicas.items() if s == service and r.kill_at is None]

    def occupied(self, service: str) -> list[int]:
        return [i for s, i in self.replicas if s == service]

    def stop_all(self) -> None:
        ray = self.ray
        stops = [r.actor.stop.remote(self.up.grace_s) for r in self.replicas.values()]
        if stops:
            _, late = ray.wait(stops, num_returns=len(stops), timeout=self.up.grace_s + KILL_MARGIN_S)
            if late:
                self.say(f"{len(late)} replica(s) did not answer their stop in time: killing their actors", error=True)
        for replica in self.replicas.values():
            ray.kill(replica.actor, no_restart=True)
        self.replicas.clear()
        ray.shutdown()
