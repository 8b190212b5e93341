"""``streamrl up RECIPE``: run a whole streamrl job on one machine.

1. If the recipe names no Redis (``redis.url``), start an embedded real ``redis-server`` on a free
   port with its data (AOF) under ``{run_dir}/redis``.
2. Start every service of ``[up]`` as a child process (``streamrl <service> RECIPE ...``), each in
   its own process group, with replicas as configured; interleave their output prefixed by name.
   ``[up] gpus`` places them: each child's ``CUDA_VISIBLE_DEVICES`` (rollout and learner on the
   same device = the colocated mode).
3. Show a live progress display (heartbeats + the coordinator's progress hash).
4. Stop: Ctrl-C / SIGTERM, or the ``until`` service exiting 0 (the run is done), stops everything
   cleanly (SIGTERM, grace, SIGKILL) and exits 0. Any child failing stops the rest and exits 1,
   naming the failing service. No process is left behind.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import redis as syncredis
from pydantic import Field, PositiveInt, model_validator

from streamrl.common.config import BaseConfig, ConfigError, apply_overrides, read_recipe, validate
from streamrl.common.health import live_heartbeats
from streamrl.common.redis_server import RedisServer
from streamrl.common.streams import StreamNames
from streamrl.common.weights_auth import KEY_ENV

SERVICES = ("coordinator", "rollout", "reward", "learner")
COLORS = {"coordinator": 36, "rollout": 32, "reward": 35, "learner": 33, "redis": 90}


class UpConfig(BaseConfig):
    """The ``[up]`` section: what the local launcher starts."""

    services: list[str] = list(SERVICES)
    """Services to start, in order."""
    replicas: dict[str, int] = {}
    """Instances per service (default 1), e.g. ``{reward = 2}``."""
    threads: dict[str, PositiveInt] = {}
    """CPU threads per service (its ``OMP_NUM_THREADS``), e.g. ``{learner = 2, rollout = 1}``; default:
    inherited from the environment."""
    until: str = "coordinator"
    """The run is over when this service exits 0."""
    grace_s: float = Field(20.0, ge=0)
    """On stop, time children get after SIGTERM before SIGKILL (s)."""
    display: bool = True
    """Show the live progress display (a line every few seconds when not a terminal)."""
    display_interval_s: float = Field(2.0, gt=0)
    gpus: dict[str, str | list[str]] = {}
    """GPU placement: service -> the ``CUDA_VISIBLE_DEVICES`` of its processes. A string applies to every
    replica, a list gives one entry per replica (as many as ``replicas``). A service without an entry
    inherits the launcher's environment. E.g. ``{rollout = ["0", "1"], learner = "2"}``; the colocated
    mode is rollout and learner on one device: ``{rollout = "0", learner = "0"}``."""

    @model_validator(mode="after")
    def _check_gpus(self) -> UpConfig:
        for service, devices in self.gpus.items():
            if service not in SERVICES:
                raise ValueError(f"up.gpus.{service}: unknown service; known: {list(SERVICES)}")
            replicas = self.replicas.get(service, 1)
            if isinstance(devices, list) and len(devices) != replicas:
                raise ValueError(
                    f"up.gpus.{service}: {len(devices)} entries for {replicas} replica(s); give one per replica "
                    "or a single string for all"
                )
        return self

    def cuda_devices(self, service: str, replica: int) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` of replica ``replica`` of ``service`` (None = inherited)."""
        devices = self.gpus.get(service)
        return devices[replica] if isinstance(devices, list) else devices


class _LaunchRecipe(BaseConfig):
    """Top level of a recipe as the launcher sees it (service sections are validated by each service)."""

    model_config = BaseConfig.model_config | {"extra": "allow"}
    run_id: str = "default"
    run_dir: str = "runs/default"
    up: UpConfig = UpConfig()


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    pump: threading.Thread


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher dies (no orphans even on SIGKILL of the launcher)."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def child_env(
    base: Mapping[str, str], instance: str, threads: int | None, cuda_devices: str | None = None
) -> dict[str, str]:
    """The environment of one service process: ``threads`` (if set) caps its CPU threads,
    ``cuda_devices`` (if set) is its ``CUDA_VISIBLE_DEVICES``."""
    env = {**base, "PYTHONUNBUFFERED": "1", "STREAMRL_INSTANCE": instance}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if cuda_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_devices
    return env


def _pump(name: str, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    color = COLORS.get(name.split("-")[0], 37)
    prefix = f"\x1b[{color}m{name:<14}\x1b[0m| " if out.isatty() else f"{name:<14}| "
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        with lock:
            out.write(prefix + line + "\n")
            out.flush()


class Launcher:
    """Starts, watches and stops the processes of one local run."""

    def __init__(self, recipe: str, overrides: list[str]) -> None:
        data = apply_overrides(read_recipe(recipe), overrides)
        self.cfg = validate(_LaunchRecipe, data, source=f"recipe {recipe}")
        unknown = [s for s in self.cfg.up.services if s not in SERVICES]
        if unknown:
            raise ConfigError(f"up.services: unknown service(s) {unknown}; known: {list(SERVICES)}")
        self.recipe = recipe
        self.overrides = overrides
        self.redis_url: str | None = (data.get("redis") or {}).get("url")
        self.names = StreamNames(self.cfg.run_id)
        self.children: list[Child] = []
        self.redis: RedisServer | None = None
        self.lock = threading.Lock()
        self.weights_key = os.environ.get(KEY_ENV) or secrets.token_hex(32)
        """The run's weights key (:mod:`streamrl.common.weights_auth`): the environment's, else a new random one."""
        self.stop_requested = False

    def start(self) -> None:
        run_dir = Path(self.cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if not self.redis_url:
            try:
                self.redis = RedisServer(run_dir / "redis").start()
            except FileNotFoundError as e:  # no redis-server anywhere: a setup problem, said plainly
                raise ConfigError(str(e)) from e
            self.redis_url = self.redis.url
            self._say(
                f"embedded redis-server at {self.redis_url} (data: {run_dir / 'redis'}); "
                f"binary {self.redis.binary}: {self.redis.version}"
            )
        for service in self.cfg.up.services:
            for i in range(self.cfg.up.replicas.get(service, 1)):
                self._spawn(service, i)

    def _spawn(self, service: str, replica: int) -> None:
        instance = f"{service}-{replica}"
        cmd = [sys.executable, "-m", "streamrl.common.cli", service, self.recipe, *self.overrides]
        cmd += [f"--instance={instance}"]
        gpus = self.cfg.up.cuda_devices(service, replica)
        env = child_env(os.environ, instance, self.cfg.up.threads.get(service), gpus)
        env.setdefault(KEY_ENV, self.weights_key)  # signs the learner's weights events; never logged
        env["STREAMRL_REDIS__URL"] = self.redis_url or ""  # not on the command line: `ps` would show a password
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )
        assert proc.stdout is not None
        pump = threading.Thread(target=_pump, args=(instance, proc.stdout, sys.stdout, self.lock), daemon=True)
        pump.start()
        self.children.append(Child(instance, proc, pump))
        placed = "inherited" if gpus is None else f"CUDA_VISIBLE_DEVICES={gpus!r}"
        self._say(f"started {instance} (pid {proc.pid}; GPUs: {placed})")

    def watch(self) -> int:
        """Wait until the run ends, a child fails, or a stop is requested. Returns the exit code."""
        next_display = time.monotonic()
        until = self.cfg.up.until
        while not self.stop_requested:
            for child in self.children:
                code = child.proc.poll()
                if code is None:
                    continue
                if code == 0 and child.name.startswith(until + "-"):
                    self._say(f"{child.name} finished: the run is complete")
                    return 0
                if code != 0 or not child.name.startswith(until + "-"):
                    self._say(f"{child.name} exited with code {code}: stopping the run", error=True)
                    print(f"streamrl up: service {child.name} failed (exit code {code})", file=sys.stderr)
                    return 1
            if self.cfg.up.display and time.monotonic() >= next_display:
                self._display()
                next_display = time.monotonic() + self.cfg.up.display_interval_s
            time.sleep(0.1)
        self._say("stop requested")
        return 0

    def stop(self) -> None:
        """SIGTERM every child's process group, wait ``grace_s``, SIGKILL the rest, stop redis."""
        for child in self.children:
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.up.grace_s
        for child in self.children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._say(f"{child.name} did not stop within {self.cfg.up.grace_s} s: killing it", error=True)
        for child in self.children:
            _signal_group(child.proc, signal.SIGKILL)  # also reaps grandchildren left in the group
            child.proc.wait()
            child.pump.join(timeout=2)
        if self.redis is not None:
            self.redis.stop()

    def _display(self) -> None:
        try:
            client = syncredis.Redis.from_url(self.redis_url or "", socket_timeout=1)
            beats = live_heartbeats(client, self.names)
            progress = {k.decode(): v.decode() for k, v in client.hgetall(self.names.state("progress")).items()}
            client.close()
        except (syncredis.RedisError, ValueError, OSError):
            return
        alive = ", ".join(sorted(f"{b.instance}:{b.status}" for b in beats))
        shown = " ".join(f"{k}={v}" for k, v in sorted(progress.items()))
        self._say(f"[progress] {shown or 'starting'} | alive: {alive or '-'}")

    def _say(self, text: str, error: bool = False) -> None:
        with self.lock:
            stream = sys.stderr if error else sys.stdout
            stream.write(f"{'up':<14}| {text}\n")
            stream.flush()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamrl up", description="Run a streamrl job locally (embedded Redis).")
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
