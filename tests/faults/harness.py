"""One run of the four real services for a fault scenario, and the faults the suite injects.

A :class:`FaultRun` owns, under its own folder:

* a real ``redis-server`` with AOF (``appendfsync always``) on a fixed free port, which
  :meth:`FaultRun.kill_redis` SIGKILLs and :meth:`FaultRun.start_redis` brings back on the same
  port with the same data;
* each service as its own OS process and process group, started the way ``streamrl up`` starts
  it (``python -m streamrl.ops.cli SERVICE RECIPE --instance=NAME``, the Redis URL and the run's
  weights key in the environment), so any one can be SIGKILLed, stopped or restarted alone;
* a supervisor thread that plays the orchestrator (compose ``restart: on-failure``): a service that
  exits non-zero when the scenario did not kill it is recorded as an unexpected exit (with the last
  lines of its log) and started again; the coordinator exiting 0 means the run is complete.

Optionally (:meth:`FaultRun.use_proxy`) some services reach Redis through a fault-injecting proxy
(tests/faults/redis_proxy.py) that can lose the replies of their writes. A :class:`tap.StreamTap`
records every entry of every stream as it is written, so a run is counted from what was written
even though streams are trimmed once consumed (``redis.retain_consumed_s``, kept small here).

Every run starts from ``recipes/smoke.toml`` (the tiny random model and data of the ``tiny_task``
fixture) with the transformers rollout engine, which starts in ~12 s here against ~45 s for vLLM,
plus the scenario's overrides (given to every service on the command line, as ``streamrl up`` does).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis as syncredis
from accounting import Lane
from redis.exceptions import ClusterDownError
from redis_proxy import FaultProxy
from resp import ScriptNames
from tap import StreamTap

from streamrl.common.config import RedisConfig
from streamrl.common.lanes import key_slot, lane_names
from streamrl.common.streams import StreamNames
from streamrl.common.weights.auth import KEY_ENV
from streamrl.ops.redis_server import RedisServer, cluster_node_args, free_port
from streamrl.ops.replicas import child_env

SERVICES = ("coordinator", "rollout", "reward", "learner")
ROOT = Path(__file__).resolve().parents[2]
RETAIN_CONSUMED_S = 2
"""``redis.retain_consumed_s`` of every scenario: consumed entries are trimmed within seconds, so the
counting cannot lean on them (it reads the tap)."""
BASE_OVERRIDES = [
    "--rollout.engine.type=hf",
    "--total_steps=12",
    "--coordinator.eval.every_steps=4",
    *([f"--redis.retain_consumed_s={RETAIN_CONSUMED_S}"] if "retain_consumed_s" in RedisConfig.model_fields else []),
]
"""Settings of every scenario on top of recipes/smoke.toml (a scenario adds its own after these)."""
SERVICE_ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
RESTART_DELAY_S = 1.0
"""The supervisor restarts a service that failed after this pause."""
STOP_GRACE_S = 20.0
LOG_TAIL_LINES = 5


@dataclass
class ServiceProcess:
    """One life of one service instance."""

    service: str
    instance: str
    proc: subprocess.Popen[bytes]
    log: Path
    started_at: float
    expected_exit: bool = False
    """The scenario killed or stopped it: its exit is not a failure."""


@dataclass
class UnexpectedExit:
    """A service process that ended on its own with a non-zero code."""

    instance: str
    code: int
    at: float
    log_tail: str

    def __str__(self) -> str:
        return f"{self.instance} exited with code {self.code}: {self.log_tail}"


@dataclass
class FaultRun:
    """See the module docstring. Use as a context manager; :meth:`close` leaves no process behind."""

    name: str
    task: Path
    """The ``tiny_task`` folder: train/eval data and the model."""
    workdir: Path
    overrides: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every service (e.g. a reward server's token)."""
    restart_on_failure: bool = True
    recipe_source: Path = ROOT / "recipes" / "smoke.toml"
    """The recipe (``{root}`` is the task folder; its ``run_dir`` goes under ``workdir``)."""
    base_overrides: list[str] = field(default_factory=lambda: list(BASE_OVERRIDES))
    slim_tap: bool = False
    """Keep the tap's trajectories and batches without their tokens (:func:`tap.slim`: a long soak)."""
    lanes: int = 1
    """Lanes of the run (:mod:`streamrl.common.lanes`): with more than one, a coordinator, a rollout and a reward
    replica per lane (``{service}-{lane}``, ``STREAMRL_LANE``), one learner, and each lane after the first on a
    redis-server of its own (AOF, ``appendfsync always``) that :meth:`kill_redis` / :meth:`start_redis` take by lane;
    lane 0 shares the home's."""
    cluster: bool = False
    """With lanes: the home and the lanes on a 3-node Redis Cluster on 127.0.0.1 (AOF on every node) instead:
    ``redis.url`` names its first node and each service connects to the node serving its keys' slot; the run id is
    chosen so that lane 1's node serves neither lane 0 nor the home (:meth:`kill_redis` ``lane=1`` kills that node)."""

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.run_id = f"f{secrets.token_hex(4)}"
        self.servers: dict[int, tuple[Path, tuple[str, ...]]] = {}
        """Port -> (data folder, extra arguments) of every redis-server of the run."""
        self.running: dict[int, RedisServer] = {}
        if self.cluster:
            nodes = [free_port() for _ in range(CLUSTER_NODES)]
            for i, port in enumerate(nodes):
                self.servers[port] = (self.workdir / f"redis-node{i}", cluster_args())
            self.run_id, homes = spread_lanes(self.lanes)
            self.port = nodes[homes[0]]
            self.lane_ports = [nodes[i] for i in homes[1:]]
            self.url = f"redis://127.0.0.1:{nodes[0]}/0"
        else:
            self.port = free_port()
            self.servers[self.port] = (self.workdir / "redis", ())
            self.url = f"redis://127.0.0.1:{self.port}/0"
            self.lane_ports = [self.port, *(free_port() for _ in range(1, self.lanes))] if self.lanes > 1 else []
            for lane, port in enumerate(self.lane_ports[1:], start=1):
                self.servers[port] = (self.workdir / f"redis-lane{lane}", ())
        self.names = StreamNames(self.run_id)
        self.redis_server = self._server(self.port)
        self.lane_sides = tuple(
            Lane(syncredis.Redis(port=port, socket_timeout=5), lane_names(self.run_id, k))
            for k, port in enumerate(self.lane_ports)
        )
        if self.lanes > 1:
            self.base_overrides.append(f"--lanes.count={self.lanes}")
            if not self.cluster:
                urls = [f"redis://127.0.0.1:{port}/0" for port in self.lane_ports]
                self.base_overrides.append(f"--lanes.urls={json.dumps(urls)}")
        self.recipe = self._write_recipe()
        self.weights_key = secrets.token_hex(32)
        self.procs: dict[str, ServiceProcess] = {}
        """Current process of each instance (by instance name)."""
        self.exits: list[UnexpectedExit] = []
        self.done = threading.Event()
        """The coordinator (every lane's) exited 0: the run is complete."""
        self.coordinators_done: set[str] = set()
        self.injected: set[tuple[str, str]] = set()
        """(stream, entry id) of every entry the scenario wrote itself (poison): not the services' work."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name=f"supervise-{self.name}", daemon=True)
        self.client = syncredis.Redis(port=self.port, socket_timeout=5)
        self.tap = StreamTap(self.port, self.names, slim=self.slim_tap)
        self.taps = [self.tap] + [
            StreamTap(port, side.names, slim=self.slim_tap)
            for port, side in zip(self.lane_ports, self.lane_sides, strict=True)
        ]
        self.instance_env: dict[str, dict[str, str]] = {}
        """The environment an instance was first started with (its lane): a restart gets it again."""
        self.proxy: FaultProxy | None = None
        self.proxied: tuple[str, ...] = ()
        """Services whose Redis URL is the proxy's (:meth:`use_proxy`)."""
        self.service_env: dict[str, dict[str, str]] = {}
        """Extra environment of every instance of one service (by service name)."""
        self.details: dict[str, object] = {}
        """What the scenario wants in its row besides the counts (tests/faults/scenario.py)."""
        self.started_at = 0.0
        self.concluded = False
        """A row was recorded for this run."""

    # -- set-up -----------------------------------------------------------------------------
    def _write_recipe(self) -> Path:
        text = self.recipe_source.read_text().replace("{root}", str(self.task))
        text = re.sub(r'(?m)^run_dir = ".*"$', f'run_dir = "{self.workdir / "run"}"', text, count=1)
        path = self.workdir / "recipe.toml"
        path.write_text(text)
        return path

    @property
    def all_overrides(self) -> list[str]:
        return [*self.base_overrides, f"--run_id={self.run_id}", *self.overrides]

    def _setting(self, key: str, default: int) -> int:
        """The last ``--key=N`` of the overrides (the recipe's ``default`` without one)."""
        values = [o.split("=", 1)[1] for o in self.all_overrides if o.startswith(f"--{key}=")]
        return int(values[-1]) if values else default

    @property
    def total_steps(self) -> int:
        return self._setting("total_steps", 4)

    @property
    def group_size(self) -> int:
        return self._setting("coordinator.group_size", 4)

    def __enter__(self) -> FaultRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def use_proxy(self, services: tuple[str, ...] = SERVICES) -> FaultProxy:
        """Put a fault proxy (passing everything through until given a policy) between ``services`` and
        Redis, each on its own listener. Call before :meth:`start`."""
        if self.proxy is None:
            self.proxy = FaultProxy(self.port, ScriptNames.from_sources(ROOT / "libs", ROOT / "services"))
        self.proxied = services
        return self.proxy

    def redis_url_of(self, service: str) -> str:
        """The Redis URL ``service`` is given: the proxy's listener for a proxied service."""
        if self.proxy is not None and service in self.proxied:
            return self.proxy.listen(service)
        return self.url

    def start(self) -> FaultRun:
        """Start redis, the stream tap, every service, and the supervisor."""
        for port in self.servers:
            self.running[port] = self._server(port).start()
        self.redis_server = self.running[self.port]
        if self.cluster:
            form_cluster(
                {port: int(extra[extra.index("--cluster-port") + 1]) for port, (_, extra) in self.servers.items()}
            )
        for tap in self.taps:
            tap.start()
        self.started_at = time.time()
        for service in SERVICES:
            if self.lanes > 1 and service != "learner":
                for lane in range(self.lanes):
                    self.start_service(service, f"{service}-{lane}", env={"STREAMRL_LANE": str(lane)})
            else:
                self.start_service(service)
        self._supervisor.start()
        return self

    def _server(self, port: int) -> RedisServer:
        data, extra = self.servers[port]
        return RedisServer(data, port=port, appendonly=True, appendfsync="always", extra_args=extra)

    def start_redis(self, lane: int = 0) -> None:
        """Start (again) the home's redis-server, or with ``lane`` > 0 that lane's, on its port with its data."""
        port = self.lane_ports[lane] if lane else self.port
        self.running[port] = self._server(port).start()
        if not lane:
            self.redis_server = self.running[port]

    def kill_redis(self, lane: int = 0) -> None:
        """SIGKILL the home's redis-server, or with ``lane`` > 0 that lane's (no shutdown, no final fsync)."""
        proc = self.running[self.lane_ports[lane] if lane else self.port].proc
        assert proc is not None
        proc.kill()
        proc.wait()

    def entries(self, stream: str) -> list[tuple[str, bytes]]:
        """Every entry written to ``stream`` (of the home or of any lane) that the taps saw."""
        for tap in self.taps:
            if stream in tap.streams:
                return tap.entries(stream)
        raise KeyError(f"no tap follows {stream}")

    def start_service(
        self,
        service: str,
        instance: str | None = None,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
    ) -> str:
        """Start one instance of ``service`` (default name ``{service}-0``) with ``extra`` overrides after
        the run's (this life only); returns the instance name."""
        instance = instance or f"{service}-0"
        log = self.workdir / "logs" / f"{instance}.log"
        log.parent.mkdir(exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "streamrl.ops.cli",
            service,
            str(self.recipe),
            *self.all_overrides,
            *(extra or []),
            f"--instance={instance}",
        ]
        if env is not None:
            self.instance_env[instance] = env
        extra_env = {**self.env, **self.service_env.get(service, {}), **self.instance_env.get(instance, {})}
        full_env = child_env({**os.environ, **SERVICE_ENV, **extra_env}, instance, None)
        full_env[KEY_ENV] = self.weights_key
        full_env["STREAMRL_REDIS__URL"] = self.redis_url_of(service)
        with log.open("ab") as out:
            out.write(f"=== {time.strftime('%H:%M:%S')} start {' '.join(cmd[2:])}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT, start_new_session=True
            )
        with self._lock:
            self.procs[instance] = ServiceProcess(service, instance, proc, log, time.time())
        return instance

    def instances(self, service: str) -> list[str]:
        with self._lock:
            return [i for i, p in self.procs.items() if p.service == service and p.proc.poll() is None]

    # -- faults -----------------------------------------------------------------------------
    def kill(self, instance: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send ``sig`` to the instance's process group (SIGKILL by default) and wait for it to end."""
        with self._lock:
            sp = self.procs[instance]
            sp.expected_exit = True
        _signal_group(sp.proc, sig)
        sp.proc.wait(timeout=STOP_GRACE_S + 10)

    def kill_rank(self, instance: str, rank: int, sig: signal.Signals = signal.SIGKILL) -> int:
        """Send ``sig`` to the process of learner rank ``rank`` inside ``instance``'s process group (a
        child the learner group started, ``RANK`` in its environment); returns its pid."""
        with self._lock:
            group = self.procs[instance].proc.pid
        for pid in _group_pids(group):
            if _environ(pid).get("RANK") == str(rank):
                os.kill(pid, sig)
                return pid
        raise AssertionError(f"{self.name}: no process of rank {rank} in {instance}'s group")

    def written(self, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Every entry written to ``stream`` so far (the tap's record), shaped as XRANGE returns them."""
        return [(eid.encode(), {b"d": payload}) for eid, payload in self.entries(stream)]

    def pause(self, instance: str) -> None:
        """SIGSTOP the instance's process group (frozen: no heartbeat, no replies)."""
        _signal_group(self.procs[instance].proc, signal.SIGSTOP)

    def resume(self, instance: str) -> None:
        _signal_group(self.procs[instance].proc, signal.SIGCONT)

    def dump_stacks(self) -> None:
        """SIGUSR1 every live service: each logs where its asyncio tasks wait (for a wedged run)."""
        with self._lock:
            live = [sp for sp in self.procs.values() if sp.proc.poll() is None]
        for sp in live:
            sp.proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)

    # -- watching ---------------------------------------------------------------------------
    def version(self) -> int:
        """The coordinator's policy version (lane 0's with lanes; -1 while redis is unreachable)."""
        client, names = (
            (self.lane_sides[0].client, self.lane_sides[0].names) if self.lane_sides else (self.client, self.names)
        )
        try:
            raw = client.get(names.state("policy_version"))
        except (syncredis.ConnectionError, syncredis.TimeoutError, ClusterDownError):
            return -1
        return int(raw) if raw is not None else 0

    def wait_until(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.done.is_set():
                raise AssertionError(f"{self.name}: the run ended before {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {what} within {timeout_s:.0f} s; {self.describe()}")
            time.sleep(0.1)

    def served(self) -> dict[str, int]:
        """Policy version each live rollout worker serves (its ``served`` entry; none while redis is down)."""
        try:
            raw = self.client.hgetall(self.names.served_versions)
        except (syncredis.ConnectionError, syncredis.TimeoutError):
            return {}
        live = set(self.instances("rollout"))
        return {k.decode(): int(v) for k, v in raw.items() if k.decode() in live}

    def wait_served(self, version: int, timeout_s: float = 120.0) -> None:
        """Wait until the policy version is ``version`` and every live rollout worker serves it."""
        self.wait_version(version, timeout_s)
        self.wait_until(
            f"every rollout worker serving version {version}",
            lambda: bool(self.served()) and min(self.served().values()) >= version,
            timeout_s,
        )

    def wait_version(self, version: int, timeout_s: float = 120.0) -> None:
        self.wait_until(f"policy version {version}", lambda: self.version() >= version, timeout_s)

    def wait_done(self, timeout_s: float, stall_s: float = 45.0) -> bool:
        """Wait until the run completes; False after ``timeout_s``, or when nothing moved on any
        stream nor in the policy version for ``stall_s`` (a wedged run)."""
        deadline = time.monotonic() + timeout_s
        last, moved_at = None, time.monotonic()
        while not self.done.wait(0.5):
            now = time.monotonic()
            mark = self._progress_mark()
            if mark != last:
                last, moved_at = mark, now
            if now > deadline or now - moved_at > stall_s:
                return False
        return True

    def _progress_mark(self) -> tuple[int, ...]:
        n = self.names
        try:
            pipe = self.client.pipeline(transaction=False)
            for stream in (n.prompts, n.trajectories, n.scored, n.batches, n.weights, n.dead):
                pipe.xlen(stream)
            return (*pipe.execute(), self.version())
        except (syncredis.ConnectionError, syncredis.TimeoutError):
            return (-1,)

    def describe(self) -> str:
        """One line: version, stream lengths and the last exits (for failure messages)."""
        mark = self._progress_mark()
        exits = "; ".join(str(e) for e in self.exits[-3:]) or "none"
        return f"version {self.version()}, stream lengths {mark[:-1]}, unexpected exits: {exits}"

    def _supervise(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                ended = [sp for sp in self.procs.values() if sp.proc.poll() is not None and not sp.expected_exit]
            for sp in ended:
                code = sp.proc.returncode
                sp.expected_exit = True  # handled once
                if sp.service == "coordinator" and code == 0:
                    self.coordinators_done.add(sp.instance)
                    if len(self.coordinators_done) == max(1, self.lanes):
                        self.done.set()
                    continue
                if code == 0 and self.done.is_set():
                    continue
                self.exits.append(UnexpectedExit(sp.instance, code, time.time(), _tail(sp.log)))
                if self.restart_on_failure and not self.done.is_set():
                    time.sleep(RESTART_DELAY_S)
                    self.start_service(sp.service, sp.instance)

    # -- tear-down --------------------------------------------------------------------------
    def stop_services(self) -> None:
        """SIGTERM every live service (they drain), SIGKILL what is left after the grace period."""
        self._stop.set()
        if self._supervisor.is_alive():
            self._supervisor.join()
        with self._lock:
            live = [sp for sp in self.procs.values() if sp.proc.poll() is None]
            for sp in live:
                sp.expected_exit = True
        for sp in live:
            _signal_group(sp.proc, signal.SIGCONT)  # a paused one must be able to stop
            _signal_group(sp.proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for sp in live:
            try:
                sp.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(sp.proc, signal.SIGKILL)
                sp.proc.wait()

    def close(self) -> None:
        self.stop_services()
        for tap in self.taps:
            tap.close()
        if self.proxy is not None:
            self.proxy.close()
        self.client.close()
        for side in self.lane_sides:
            side.client.close()
        for server in self.running.values():
            server.stop()


CLUSTER_NODES = 3


def cluster_args() -> tuple[str, ...]:
    """``redis-server`` arguments of a node of the run's Redis Cluster: the other nodes keep serving their slots
    while one is down."""
    return cluster_node_args("--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no")


def node_of_slot(slot: int) -> int:
    """Which of the :data:`CLUSTER_NODES` nodes serves ``slot`` (:func:`form_cluster`'s even split)."""
    return min(slot * CLUSTER_NODES // 16384, CLUSTER_NODES - 1)


def spread_lanes(lanes: int) -> tuple[str, list[int]]:
    """A run id whose last lane is on a node serving neither the home nor any other lane, and the node of the
    home and of each lane (in lane order)."""
    while True:
        run_id = f"f{secrets.token_hex(4)}"
        keys = [StreamNames(run_id).prompts, *(lane_names(run_id, k).prompts for k in range(lanes))]
        homes = [node_of_slot(key_slot(k)) for k in keys]
        if homes[-1] not in homes[:-1]:
            return run_id, homes


def form_cluster(bus_ports: dict[int, int], timeout_s: float = 30.0) -> None:
    """Make the nodes on the ports of ``bus_ports`` (port -> its cluster bus port) one cluster, the slots split
    evenly in that order (:func:`node_of_slot`)."""
    ports = list(bus_ports)
    clients = [syncredis.Redis(port=port, socket_timeout=5) for port in ports]
    try:
        for i, client in enumerate(clients):
            first = next(s for s in range(16384) if node_of_slot(s) == i)
            last = max(s for s in range(16384) if node_of_slot(s) == i)
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for port in ports[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus_ports[port])
        deadline = time.monotonic() + timeout_s
        while not all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients) or any(
            len(c.execute_command("CLUSTER", "SLOTS")) < len(ports) for c in clients
        ):
            if time.monotonic() > deadline:
                raise AssertionError(f"the {len(ports)}-node Redis Cluster did not come up in {timeout_s:g} s")
            time.sleep(0.1)
    finally:
        for client in clients:
            client.close()


MakeRun = Callable[..., FaultRun]
"""The ``fault_run`` fixture: ``fault_run(name, overrides=None, env=None) -> FaultRun`` (not started)."""


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    out.append(int(entry.name))
            except ProcessLookupError:
                continue
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _tail(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(ln[:300] for ln in lines[-LOG_TAIL_LINES:])
