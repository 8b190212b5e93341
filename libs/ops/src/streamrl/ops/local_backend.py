"""The local backend of ``streamrl up`` (``[up] backend = "local"``): every replica a child process.

Each replica runs ``streamrl <service> RECIPE ...`` (:func:`streamrl.ops.replicas.service_command`) in
its own process group, its output interleaved on the launcher's stdout prefixed by its instance name
(coloured on a terminal); ``[up] gpus`` gives each its ``CUDA_VISIBLE_DEVICES``. A crashed replica is
restarted by the launcher after a doubling backoff while ``[up] max_restarts`` allows. With lanes the launcher
hands it units (:mod:`streamrl.ops.lane_plan`, ``rollout-lane1``): the service's command, threads, GPUs and
restarts, plus ``STREAMRL_LANE``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO

from streamrl.ops.lane_plan import split_unit, unit_env
from streamrl.ops.replicas import Ended, Say, child_env, die_with_parent, service_command, signal_group
from streamrl.ops.scaling import instance_name
from streamrl.ops.up_config import UpConfig

COLORS = {"coordinator": 36, "rollout": 32, "reward": 35, "learner": 33, "redis": 90}
"""ANSI colour of each service's prefix on a terminal."""


def pump_lines(name: str, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    """Copy ``stream`` to ``out`` line by line, each prefixed by ``name`` (coloured on a terminal)."""
    color = COLORS.get(name.split("-")[0], 37)
    prefix = f"\x1b[{color}m{name:<14}\x1b[0m| " if out.isatty() else f"{name:<14}| "
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        with lock:
            out.write(prefix + line + "\n")
            out.flush()


@dataclass
class LocalReplica:
    service: str
    """Its unit: the service, or the service of one lane (:func:`~streamrl.ops.lane_plan.unit_name`)."""
    index: int
    name: str
    proc: subprocess.Popen[bytes]
    pump: threading.Thread
    kill_at: float | None = None
    """Set once it is being drained: when it gets SIGKILL."""


class LocalReplicas:
    """The local backend: every replica a child process of the launcher, restarted by the launcher.

    A crashed replica restarts after ``restart_backoff_s * 2**k`` (k = its restarts so far) while it has
    ``max_restarts`` left, as ``{service}-{index}.{n}``.
    """

    def __init__(
        self, up: UpConfig, recipe: str, overrides: list[str], env: Mapping[str, str], say: Say, lock: threading.Lock
    ) -> None:
        self.up = up
        self.recipe = recipe
        self.overrides = overrides
        self.env = dict(env)
        """Environment every replica starts from (the Redis URL and weights key in it)."""
        self.say = say
        self.lock = lock
        """Held while a line is written to the terminal."""
        self.running: list[LocalReplica] = []
        self.incarnations: dict[tuple[str, int], int] = {}
        self.restarts: dict[tuple[str, int], int] = {}
        self.due: dict[tuple[str, int], float] = {}
        """Replicas waiting for their restart: when."""

    def start(self, unit: str, index: int) -> None:
        service = split_unit(unit)[0]
        incarnation = self.incarnations.get((unit, index), 0)
        self.incarnations[(unit, index)] = incarnation + 1
        name = instance_name(unit, index, incarnation)
        gpus = self.up.cuda_devices(service, index)
        env = child_env({**self.env, **unit_env(unit)}, name, self.up.threads.get(service), gpus)
        cmd = service_command(sys.executable, service, self.recipe, self.overrides, name)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
        )
        assert proc.stdout is not None
        pump = threading.Thread(target=pump_lines, args=(name, proc.stdout, sys.stdout, self.lock), daemon=True)
        pump.start()
        self.running.append(LocalReplica(unit, index, name, proc, pump))
        placed = "inherited" if gpus is None else f"CUDA_VISIBLE_DEVICES={gpus!r}"
        self.say(f"started {name} (pid {proc.pid}; GPUs: {placed})")

    def drain(self, service: str, index: int) -> None:
        if self.due.pop((service, index), None) is not None:
            self.say(f"{service}-{index}: restart cancelled (scaled down)")
            return
        for replica in self.running:
            if (replica.service, replica.index) == (service, index) and replica.kill_at is None:
                replica.kill_at = time.monotonic() + self.up.grace_s
                signal_group(replica.proc, signal.SIGTERM)
                self.say(f"draining {replica.name} (scaled down)")

    def poll(self) -> list[Ended]:
        now = time.monotonic()
        ended: list[Ended] = []
        for replica in list(self.running):
            code = replica.proc.poll()
            if code is None:
                if replica.kill_at is not None and now >= replica.kill_at:
                    self.say(f"{replica.name} did not stop within {self.up.grace_s} s: killing it", error=True)
                    signal_group(replica.proc, signal.SIGKILL)
                    replica.kill_at = float("inf")
                continue
            self.running.remove(replica)
            replica.pump.join(timeout=2)
            key = (replica.service, replica.index)
            service = split_unit(replica.service)[0]
            if replica.kill_at is not None or (code == 0 and service == self.up.until):
                ended.append(Ended(*key, replica.name, code, removed=replica.kill_at is not None))
                continue
            used = self.restarts.get(key, 0)
            if used < self.up.max_restarts.get(service, 0):
                delay = self.up.restart_backoff_s * 2**used
                self.restarts[key] = used + 1
                self.due[key] = now + delay
                self.say(
                    f"{replica.name} exited with code {code}: restart {used + 1} of "
                    f"{self.up.max_restarts[service]} in {delay:.1f} s",
                    error=True,
                )
                continue
            ended.append(Ended(*key, replica.name, code, removed=False))
        for key, when in list(self.due.items()):
            if now >= when:
                del self.due[key]
                self.start(*key)
        return ended

    def active(self, service: str) -> list[int]:
        running = [r.index for r in self.running if r.service == service and r.kill_at is None]
        return running + [i for s, i in self.due if s == service]

    def occupied(self, service: str) -> list[int]:
        return self.active(service) + [r.index for r in self.running if r.service == service and r.kill_at is not None]

    def stop_all(self) -> None:
        self.due.clear()
        for replica in self.running:
            signal_group(replica.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.up.grace_s
        for replica in self.running:
            try:
                replica.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{replica.name} did not stop within {self.up.grace_s} s: killing it", error=True)
        for replica in self.running:
            signal_group(replica.proc, signal.SIGKILL)  # also reaps grandchildren left in the group
            replica.proc.wait()
            replica.pump.join(timeout=2)
        self.running.clear()
