"""``streamrl up RECIPE``: run a whole streamrl job, on this machine or on a Ray cluster.

1. If the recipe names no Redis (``redis.url``), start an embedded real ``redis-server`` on a free
   port with its data (AOF, ``[up] redis_appendfsync``) under ``{run_dir}/redis``, closed by a new password per
   service (:mod:`streamrl.ops.embedded_auth`), its ``maxmemory`` the run's memory bound
   (:mod:`streamrl.ops.memory_budget`) times ``[up.redis_memory] margin`` and its policy
   ``noeviction``; both are printed. A Redis named by ``redis.url`` is checked instead: a WARNING when
   its ``maxmemory-policy`` could evict streamrl keys or its ``maxmemory`` is below the bound
   (docs/operations.md). Write ``{run_dir}/up.json`` (:mod:`streamrl.common.run_info`) so
   ``streamrl scale`` finds the run.
2. Start every service of ``[up]`` with replicas as configured, on the backend of ``[up] backend``:
   ``local`` (:mod:`streamrl.ops.local_backend`): each replica a child process
   (``streamrl <service> RECIPE ...``) in its own process group, its output interleaved prefixed by
   its instance name, ``[up] gpus`` giving each its ``CUDA_VISIBLE_DEVICES`` (rollout and learner
   on the same device = the colocated mode); ``ray`` (:mod:`streamrl.ops.ray_backend`): each
   replica a Ray actor running the same command as its child.
3. Watch: show a live progress display (heartbeats + the coordinator's progress hash + Redis's
   ``used_memory``; the embedded server's above the run's bound is one WARNING, and its peak is
   printed at the end), and every
   ``reconcile_interval_s`` bring rollout and reward to the replica counts asked for in the run's
   replicas hash (:mod:`streamrl.ops.scaling`): new replicas at the next free index, removed
   ones drained (SIGTERM, ``grace_s``, then SIGKILL). A removed replica's exit is not a failure.
4. A crashed replica (non-zero exit, or any exit but the ``until`` service's exit 0) is restarted
   under a new instance name (local: after ``restart_backoff_s``, doubling; Ray: Ray's own actor restart)
   until it crash-loops (``[up] crash_loop_limit`` crashes within ``crash_loop_window_s``), runs out of
   ``[up] max_restarts``, or exits 2 (it refuses its configuration); then it stops the run, its last error
   on screen.
5. Stop: Ctrl-C / SIGTERM, or the ``until`` service exiting 0 (the run is done), stops everything
   cleanly (SIGTERM, grace, SIGKILL) and exits 0. A service failing for good stops the rest and
   exits 1, naming it. No process is left behind.

Lanes (``lanes.count = K > 1``, :mod:`streamrl.ops.lane_plan`): one coordinator per lane, ``up.replicas``
rollout and reward replicas *per lane* (each with ``STREAMRL_LANE``), one learner; without ``redis.url`` and
``lanes.urls`` one embedded redis-server per lane (lane 0's, under ``{run_dir}/redis``, also the home; lane k's
under ``{run_dir}/redis-lane{k}``, each with an even share of the run's ``maxmemory``), their URLs given to every service as
``lanes.urls``. ``streamrl scale`` counts are per lane too; ``autoscale`` is refused with lanes (it reads the
home's backlogs, which lanes do not fill). With ``until = "coordinator"`` the run is done when lane 0's
coordinator exits 0 (another lane's coordinator exiting 0 is not a failure).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import redis as syncredis

from streamrl.common.config import ConfigError, apply_overrides, read_recipe, validate
from streamrl.common.config_docs import config_help, field_docs
from streamrl.common.health import live_heartbeats
from streamrl.common.lanes import lane_names
from streamrl.common.replies import text
from streamrl.common.run_info import RunInfo, write_run_info
from streamrl.common.streams import StreamNames
from streamrl.common.weights.auth import KEY_ENV
from streamrl.ops.autoscale import Autoscaler
from streamrl.ops.embedded_auth import LAUNCHER, LAUNCHER_URL_FILE, new_passwords, user_url, write_files
from streamrl.ops.gpu_plan import plan_run
from streamrl.ops.lane_plan import embedded_servers, home_url, lanes_env, server_maxmemory, split_unit, units
from streamrl.ops.local_backend import LocalReplicas
from streamrl.ops.memory_budget import (
    MIB,
    MemoryBound,
    maxmemory_for,
    memory_bound,
    policy_warnings,
    shape_from_recipe,
)
from streamrl.ops.redis_server import RedisServer, free_port, memory_settings
from streamrl.ops.replicas import Replicas
from streamrl.ops.scaling import desired_count, desired_replicas, plan, request_replicas
from streamrl.ops.up_config import SCALABLE, SERVICES, LaunchRecipe

MEMORY_CHECK_S = 5.0
"""How often the launcher reads Redis's ``used_memory`` (s)."""


class Launcher:
    """Starts, watches, scales and stops the replicas of one run."""

    def __init__(self, recipe: str, overrides: list[str]) -> None:
        data = apply_overrides(read_recipe(recipe), overrides)
        self.cfg = validate(LaunchRecipe, data, source=f"recipe {recipe}")
        unknown = [s for s in self.cfg.up.services if s not in SERVICES]
        if unknown:
            raise ConfigError(f"up.services: unknown service(s) {unknown}; known: {list(SERVICES)}")
        self.recipe = recipe
        self.overrides = overrides
        self.lanes = self.cfg.lanes
        self.redis_url: str | None = home_url((data.get("redis") or {}).get("url"), self.lanes.urls)
        self.units = units(self.cfg.up.services, self.lanes.count)
        """What the backend places: the services, or with lanes each lane's coordinator, rollout and reward."""
        self.learner_ranks = int((data.get("learner") or {}).get("ranks", 1))
        self.names = StreamNames(self.cfg.run_id)
        try:
            self.memory: MemoryBound = memory_bound(shape_from_recipe(data))
        except ValueError as e:
            raise ConfigError(str(e)) from e
        """The run's Redis memory bound (docs/operations.md)."""
        self.replicas: Replicas | None = None
        self.redis: RedisServer | None = None
        self.lane_clients: list[tuple[syncredis.Redis, StreamNames]] = []
        """A client of each lane's Redis and the lane's names (with lanes; cluster URLs not resolved: display only)."""
        self.lane_servers: list[RedisServer] = []
        """The embedded redis-servers of lanes 1.. (lane 0's is :attr:`redis`, the home)."""
        self.client: syncredis.Redis | None = None
        self.lock = threading.Lock()
        self.passwords: dict[str, str] = {}
        """The embedded Redis's password of each user (:mod:`streamrl.ops.embedded_auth`; empty: an external Redis)."""
        self.weights_key = os.environ.get(KEY_ENV) or secrets.token_hex(32)
        """The run's weights key (:mod:`streamrl.common.weights.auth`): the environment's, else a new random one."""
        self.stop_requested = False
        self.used_memory: int | None = None
        """Redis's ``used_memory`` at the last look (None: not read yet, or not readable)."""
        self._memory_readable = True
        self._memory_warned = False
        self.autoscaler = Autoscaler(self.cfg.autoscale, self.names)
        plans, refusal = plan_run(data)
        for gpu in plans:  # before anything is loaded: what each GPU will hold (docs/gpu.md, "The memory plan")
            print(f"streamrl up: memory plan\n{gpu.render()}", flush=True)
        if refusal:
            raise ConfigError(refusal)

    def start(self) -> None:
        up = self.cfg.up
        if up.backend == "ray" and up.ray_address and up.ray_address.startswith("ray://") and not self.redis_url:
            raise ConfigError(
                "redis.url: a Ray cluster reached through ray:// cannot reach the embedded redis-server (it listens "
                "on 127.0.0.1 of this machine); set redis.url to a Redis every node reaches"
            )
        run_dir = Path(self.cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        lane_urls: list[str] = []
        if not self.redis_url:
            self.redis_url, lane_urls = self.start_embedded(run_dir)
        self.client = syncredis.Redis.from_url(self.login(self.redis_url), socket_timeout=2)
        if self.lanes.enabled:  # the display's view of each lane's heartbeats (a lane's services beat there)
            urls = lane_urls or [self.lanes.url(k, self.redis_url) for k in range(self.lanes.count)]
            self.lane_clients = [
                (syncredis.Redis.from_url(self.login(url), socket_timeout=2), lane_names(self.cfg.run_id, k))
                for k, url in enumerate(urls)
            ]
        if self.redis is None:
            self.check_external_memory()
        scalable = {s: up.replicas.get(s, 1) for s in SCALABLE if s in up.services}
        if scalable:  # the recipe's counts are the run's desired counts until `streamrl scale` changes them
            request_replicas(self.client, self.names, scalable, max_replicas=up.max_replicas)
        info = RunInfo(
            run_id=self.cfg.run_id,
            redis_url=self.redis_url,
            backend=up.backend,
            max_replicas=dict(up.max_replicas),
            recipe=str(Path(self.recipe).resolve()),
            pid=os.getpid(),
            lanes=self.lanes.count,
            lane_urls=lane_urls or list(self.lanes.urls),
            redis_password=bool(self.passwords),
            credentials=str((run_dir / "redis" / LAUNCHER_URL_FILE).resolve()) if self.passwords else "",
        )
        write_run_info(run_dir, info)
        # the URL is not on the command line: `ps` would show a password
        env = {**os.environ, "STREAMRL_REDIS__URL": self.redis_url, **lanes_env(lane_urls)}
        env.setdefault(KEY_ENV, self.weights_key)  # signs the learner's weights events; never logged
        service_env = {s: self.service_env(s, self.redis_url, lane_urls) for s in SERVICES} if self.passwords else {}
        self.replicas = self._backend(env, service_env)
        for unit in self.units:
            for i in range(up.replicas.get(split_unit(unit)[0], 1)):
                self.replicas.start(unit, i)

    def login(self, url: str) -> str:
        """``url`` logged in as the launcher's user (the embedded Redis; an external one's URL as given)."""
        return user_url(url, LAUNCHER, self.passwords[LAUNCHER]) if self.passwords else url

    def service_env(self, service: str, url: str, lane_urls: list[str]) -> dict[str, str]:
        """The Redis URLs of ``service`` on the embedded Redis: logged in as its own user (never logged: only
        its process's environment holds them)."""
        password = self.passwords[service]
        lanes = [user_url(lane, service, password) for lane in lane_urls]
        return {"STREAMRL_REDIS__URL": user_url(url, service, password), **lanes_env(lanes)}

    def start_embedded(self, run_dir: Path) -> tuple[str, list[str]]:
        """Start the embedded redis-server (one per lane with lanes, lane 0's the home) with a new password per
        user (:mod:`streamrl.ops.embedded_auth`); the home's URL and the lanes' (without passwords)."""
        up = self.cfg.up
        lane_urls: list[str] = []
        total = self.embedded_maxmemory()
        servers = embedded_servers(self.lanes.count, self.redis_url, self.lanes.urls)
        maxmemory = server_maxmemory(total, servers)  # the run's bound is shared by its lanes' servers
        self.passwords = new_passwords()
        login = (LAUNCHER, self.passwords[LAUNCHER])
        data_dir = run_dir / "redis"
        try:
            port = free_port()
            acl = write_files(
                data_dir, self.cfg.run_id, self.passwords, f"redis://127.0.0.1:{port}/0", self.lanes.count
            )
            fsync = up.redis_appendfsync
            self.redis = RedisServer(
                data_dir, port=port, appendfsync=fsync, maxmemory=maxmemory, aclfile=acl, login=login
            ).start()
            for k in range(1, servers):
                lane = RedisServer(
                    run_dir / f"redis-lane{k}", appendfsync=fsync, maxmemory=maxmemory, aclfile=acl, login=login
                )
                self.lane_servers.append(lane.start())
        except FileNotFoundError as e:  # no redis-server anywhere: a setup problem, said plainly
            raise ConfigError(str(e)) from e
        self._say(
            f"embedded redis-server at {self.redis.url} (data: {data_dir}, appendfsync {fsync}); "
            f"binary {self.redis.binary}: {self.redis.version}"
        )
        self._say(
            f"redis users: one per service, new passwords, default user off; the launcher's login for tools "
            f"(streamrl scale) is in {data_dir / LAUNCHER_URL_FILE} (mode 0600)"
        )
        if self.lanes.enabled:
            lane_urls = [self.redis.url, *(server.url for server in self.lane_servers)]
            for k, server in enumerate(self.lane_servers, start=1):
                self._say(f"embedded redis-server of lane {k} at {server.url} (data: {run_dir / f'redis-lane{k}'})")
            self._say(f"lane 0 on the home's redis-server; {self.lanes.count} lanes")
        limit = f"{maxmemory / MIB:.0f} MiB" if maxmemory else "0 (no limit)"
        each = f" on each of {servers} servers ({total / MIB:.0f} MiB in all)" if servers > 1 and maxmemory else ""
        self._say(
            f"redis maxmemory {limit}{each}, maxmemory-policy noeviction; this run's memory bound: "
            f"{self.memory.describe()}"
        )
        if 0 < total < self.memory.total:
            self._say(
                f"WARNING: up.redis_memory.maxmemory_mb is below this run's memory bound "
                f"({self.memory.total / MIB:.0f} MiB): writes will wait for memory",
                error=True,
            )
        if up.backend == "ray" and up.ray_address:
            self._say(
                "note: the embedded redis-server listens on 127.0.0.1: Ray workers on other nodes cannot "
                "reach it (set redis.url for a multi-node cluster)",
                error=True,
            )
        return self.redis.url, lane_urls

    def embedded_maxmemory(self) -> int:
        """``maxmemory`` of the embedded redis-server (bytes, 0 = no limit): ``[up.redis_memory]
        maxmemory_mb`` if set, else the run's bound times its margin."""
        settings = self.cfg.up.redis_memory
        if settings.maxmemory_mb is not None:
            return int(settings.maxmemory_mb * MIB)
        return maxmemory_for(self.memory, settings.margin)

    def check_external_memory(self) -> None:
        """Warn when the external Redis could evict streamrl keys or holds less than the run's bound."""
        assert self.client is not None
        try:
            maxmemory, policy = memory_settings(self.client)
        except (syncredis.RedisError, OSError, ValueError) as e:
            self._say(
                f"WARNING: could not read the Redis server's maxmemory settings ({e}); make sure its "
                "maxmemory-policy is noeviction (docs/operations.md)",
                error=True,
            )
            return
        limit = f"{maxmemory / MIB:.0f} MiB" if maxmemory else "0 (no limit)"
        self._say(
            f"redis maxmemory {limit}, maxmemory-policy {policy}; this run's memory bound: {self.memory.describe()}"
        )
        for problem in policy_warnings(policy, maxmemory, self.memory):
            self._say(f"WARNING: {problem} (docs/operations.md)", error=True)

    def _backend(self, env: dict[str, str], service_env: dict[str, dict[str, str]]) -> Replicas:
        up = self.cfg.up
        if up.backend == "local":
            for field in ("resources", "ray_address", "ray_num_cpus"):
                if getattr(up, field):
                    self._say(f"note: up.{field} has no effect with up.backend = 'local'", error=True)
            return LocalReplicas(up, self.recipe, self.overrides, env, self._say, self.lock, service_env)
        try:
            from streamrl.ops.ray_backend import RayReplicas
        except ImportError as e:
            raise ConfigError(f"up.backend = 'ray' needs Ray: pip install 'streamrl-ops[ray]' ({e})") from e
        assert self.redis_url is not None
        return RayReplicas(
            up,
            self.cfg.run_id,
            self.recipe,
            self.overrides,
            env,
            self.learner_ranks,
            self._say,
            service_env,
            self.login(self.redis_url),
        )

    def watch(self) -> int:
        """Wait until the run ends, a service fails for good, or a stop is requested. Returns the exit code."""
        assert self.replicas is not None
        next_display = next_memory = time.monotonic()
        next_reconcile = time.monotonic() + self.cfg.up.reconcile_interval_s
        until = self.cfg.up.until
        while not self.stop_requested:
            for gone in self.replicas.poll():
                if gone.removed:
                    self._say(f"{gone.name} removed (exit code {gone.code})")
                    continue
                service, lane = split_unit(gone.service)
                if gone.code == 0 and service == until and lane:  # another lane's: the run ends with lane 0's
                    self._say(f"{gone.name} finished")
                    continue
                if gone.code == 0 and service == until:
                    self._say(f"{gone.name} finished: the run is complete")
                    return 0
                why = gone.detail or f"exit code {gone.code}"
                self._say(f"{gone.name} exited ({why}): stopping the run", error=True)
                print(f"streamrl up: service {gone.name} failed ({why})", file=sys.stderr)
                return 1
            if time.monotonic() >= next_reconcile:
                self._reconcile()
                next_reconcile = time.monotonic() + self.cfg.up.reconcile_interval_s
            if time.monotonic() >= next_memory:
                self.check_memory()
                next_memory = time.monotonic() + MEMORY_CHECK_S
            if self.cfg.up.display and time.monotonic() >= next_display:
                self._display()
                next_display = time.monotonic() + self.cfg.up.display_interval_s
            time.sleep(0.1)
        self._say("stop requested")
        return 0

    def _reconcile(self) -> None:
        """Start or drain rollout and reward replicas to match the run's replicas hash (which the
        autoscaler, when enabled, sets first from the backlogs)."""
        assert self.replicas is not None and self.client is not None
        try:
            desired = desired_replicas(self.client, self.names)
            changes = self.autoscaler.tick(self.client, desired)
            if changes:
                request_replicas(
                    self.client, self.names, {c.service: c.new for c in changes}, max_replicas=self.cfg.up.max_replicas
                )
                for change in changes:
                    self._say(str(change))
                desired = desired_replicas(self.client, self.names)
        except (syncredis.RedisError, OSError):
            return  # Redis briefly away: the next round catches up
        for unit in self.units:  # with lanes the counts are per lane
            count = desired_count(desired, unit)
            if count is None or split_unit(unit)[0] not in SCALABLE:
                continue
            start, drain = plan(count, self.replicas.active(unit), self.replicas.occupied(unit))
            if start or drain:
                self._say(f"scaling {unit}: {len(self.replicas.active(unit))} -> {count} replicas")
            for index in drain:
                self.replicas.drain(unit, index)
            for index in start:
                self.replicas.start(unit, index)

    def check_memory(self) -> int | None:
        """Read Redis's ``used_memory`` (None: unreadable, e.g. an ACL user without ``INFO``); one WARNING
        the first time the embedded server holds more than the run's bound (something grows that the
        bound does not count). An external server may hold other runs too: it is shown, not judged."""
        if self.client is None or not self._memory_readable:
            return None
        try:
            used = int(self.client.info("memory")["used_memory"])
        except syncredis.ResponseError:  # NOPERM: this user may not run INFO; do not ask again
            self._memory_readable = False
            return None
        except (syncredis.RedisError, OSError, KeyError, ValueError):
            return None
        self.used_memory = used
        if self.redis is not None and used > self.memory.total and not self._memory_warned:
            self._memory_warned = True
            self._say(
                f"WARNING: redis holds {used / MIB:.0f} MiB, more than this run's memory bound of "
                f"{self.memory.total / MIB:.0f} MiB: something grows that the bound does not count, or an "
                "assumption of [up.redis_memory] is off (docs/operations.md, 'Reading memory use')",
                error=True,
            )
        return used

    def stop(self) -> None:
        """Stop every replica (SIGTERM, ``grace_s``, SIGKILL), then the embedded redis (its peak memory printed)."""
        if self.replicas is not None:
            self.replicas.stop_all()
        if self.client is not None:
            if self.redis is not None:
                try:
                    peak = int(self.client.info("memory")["used_memory_peak"])
                    self._say(
                        f"redis used_memory peak {peak / MIB:.1f} MiB (this run's bound: "
                        f"{self.memory.total / MIB:.1f} MiB)"
                    )
                except (syncredis.RedisError, OSError, KeyError, ValueError):
                    pass
            self.client.close()
        for client, _ in self.lane_clients:
            client.close()
        if self.redis is not None:
            self.redis.stop()
        for server in self.lane_servers:
            server.stop()

    def _display(self) -> None:
        assert self.client is not None
        try:
            beats = live_heartbeats(self.client, self.names)
            progress = {text(k): text(v) for k, v in self.client.hgetall(self.names.state("progress")).items()}
        except (syncredis.RedisError, ValueError, OSError):
            return
        unreachable = []
        for lane, (client, names) in enumerate(self.lane_clients):  # one lane's Redis down hides only that lane
            try:
                beats += live_heartbeats(client, names)
                if not progress:  # with lanes, lane 0's coordinator's progress
                    progress = {text(k): text(v) for k, v in client.hgetall(names.state("progress")).items()}
            except (syncredis.RedisError, ValueError, OSError):
                unreachable.append(f"lane {lane}")
        if unreachable:
            progress["unreachable"] = "+".join(unreachable)
        alive = ", ".join(sorted(f"{b.instance}:{b.status}" for b in beats))
        shown = " ".join(f"{k}={v}" for k, v in sorted(progress.items()))
        memory = f" | redis {self.used_memory / MIB:.0f} MiB" if self.used_memory is not None else ""
        self._say(f"[progress] {shown or 'starting'} | alive: {alive or '-'}{memory}")

    def _say(self, text: str, error: bool = False) -> None:
        with self.lock:
            stream = sys.stderr if error else sys.stdout
            stream.write(f"{'up':<14}| {text}\n")
            stream.flush()


def main(argv: list[str]) -> int:
    rows = [row for row in field_docs(LaunchRecipe) if row.path.split(".", 1)[0] in ("up", "autoscale")]
    epilog = f"config fields ([up] and [autoscale] tables; --up.FIELD=VALUE):\n\n{config_help(rows)}"
    parser = argparse.ArgumentParser(
        prog="streamrl up",
        description="Run a streamrl job (local processes or Ray).",
        epilog=epilog if {"-h", "--help"} & set(argv) else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe")
    args, overrides = parser.parse_known_args(argv)
    try:
        launcher = Launcher(args.recipe, overrides)
    except ConfigError as e:
        print(f"streamrl up: {e}", file=sys.stderr)
        return 2

    def _on_signal(signum: int, _frame: object) -> None:
        launcher.stop_requested = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    code = 1
    try:
        launcher.start()
        code = launcher.watch()
    except ConfigError as e:
        print(f"streamrl up: {e}", file=sys.stderr)
        code = 2
    finally:
        launcher.stop()
    return code
