"""The local backend of ``streamrl up`` (``[up] backend = "local"``): every replica a child process.

Each replica runs ``streamrl <service> RECIPE ...`` (:func:`streamrl.ops.replicas.service_command`) in
its own process group, its output interleaved on the launcher's stdout prefixed by its instance name
(coloured on a terminal); ``[up] gpus`` gives each its ``CUDA_VISIBLE_DEVICES``; each service its own
Redis login (``service_env``). A crashed replica is restarted by the launcher after a doubling backoff until
it crash-loops (``[up] crash_loop_limit`` crashes within ``crash_loop_window_s``), which ends the run with
its last error on screen. With lanes the launcher
hands it units (:mod:`streamrl.ops.lane_plan`, ``rollout-lane1``): the service's command, threads, GPUs and
restarts, plus ``STREAMRL_LANE``.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from streamrl.ops.lane_plan import split_unit, unit_env
from streamrl.ops.replicas import Ended, Say, child_env, die_with_parent, service_command, signal_group
from streamrl.ops.scaling import instance_name
from streamrl.ops.up_config import UpConfig

COLORS = {"coordinator": 36, "rollout": 32, "reward": 35, "learner": 33, "redis": 90}
"""ANSI colour of each service's prefix on a terminal."""


TAIL_LINES = 20
"""Lines of a replica's output kept to show when it fails for good."""
_ERROR_LINE = re.compile(r"Error|Exception|ERROR|CRITICAL|Traceback|refuse")


def pump_lines(name: str, stream: IO[bytes], out: IO[str], lock: threading.Lock, tail: deque[str]) -> None:
    """Copy ``stream`` to ``out`` line by line, each prefixed by ``name`` (coloured on a terminal); the last
    lines stay in ``tail``."""
    color = COLORS.get(name.split("-")[0], 37)
    prefix = f"\x1b[{color}m{name:<14}\x1b[0m| " if out.isatty() else f"{name:<14}| "
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        tail.append(line)
        with lock:
            out.write(prefix + line + "\n")
            out.flush()


def last_error(lines: Sequence[str]) -> str:
    """The last line of ``lines`` that reads as an error (else the last line; empty if none)."""
    for line in reversed(lines):
        if _ERROR_LINE.search(line):
            return line.strip()
    return lines[-1].strip() if lines else ""


def crash_verdict(crashes: int, restarts: int, limit: int, window_s: float, max_restarts: int | None) -> str | None:
    """Why a replica that just crashed must not restart (None: it restarts). ``crashes``: its crashes within
    the last ``window_s`` (this one included); ``restarts``: its restarts so far in the run."""
    if crashes >= limit:
        return f"crashed {crashes} times within {window_s:g} s (up.crash_loop_limit = {limit})"
    if max_restarts is not None and restarts >= max_restarts:
        return f"no restart left (up.max_restarts = {max_restarts})"
    return None


@dataclass
class LocalReplica:
    service: str
    """Its unit: the service, or the service of one lane (:func:`~streamrl.ops.lane_plan.unit_name`)."""
    index: int
    name: str
    proc: subprocess.Popen[bytes]
    pump: threading.Thread
    tail: deque[str]
    """Its last lines of output."""
    kill_at: float | None = None
    """Set once it is being drained: when it gets SIGKILL."""


class LocalReplicas:
    """The local backend: every replica a child process of the launcher, restarted by the launcher.

    A crashed replica restarts as ``{service}-{index}.{n}`` after ``restart_backoff_s * 2**(k-1)`` (k = its
    crashes within ``crash_loop_window_s``, at most ``restart_backoff_max_s``), unless that is its
    ``crash_loop_limit``-th crash within the window, it has no ``max_restarts`` left, or it exited 2 (it
    refuses its configuration: a restart would not help); then it ends the run, its last error shown.
    """

    def __init__(
        self,
        up: UpConfig,
        recipe: str,
        overrides: list[str],
        env: Mapping[str, str],
        say: Say,
        lock: threading.Lock,
        service_env: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.up = up
        self.recipe = recipe
        self.overrides = overrides
        self.env = dict(env)
        """Environment every replica starts from (the Redis URL and weights key in it)."""
        self.service_env = {s: dict(e) for s, e in (service_env or {}).items()}
        """Set over :attr:`env` for the replicas of one service (its own Redis login)."""
        self.crashes: dict[tuple[str, int], deque[float]] = {}
        """Each replica's crash times (monotonic s) within the last ``crash_loop_window_s``."""
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
        base = {**self.env, **self.service_env.get(service, {}), **unit_env(unit)}
        env = child_env(base, name, self.up.threads.get(service), gpus)
        cmd = service_command(sys.executable, service, self.recipe, self.overrides, name)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
        )
        assert proc.stdout is not None
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        pump = threading.Thread(target=pump_lines, args=(name, proc.stdout, sys.stdout, self.lock, tail), daemon=True)
        pump.start()
        self.running.append(LocalReplica(unit, index, name, proc, pump, tail))
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
            crashes = self.crashes.setdefault(key, deque())
            crashes.append(now)
            while crashes[0] < now - self.up.crash_loop_window_s:
                crashes.popleft()
            used = self.restarts.get(key, 0)
            up = self.up
            why = crash_verdict(
                len(crashes), used, up.crash_loop_limit, up.crash_loop_window_s, up.max_restarts.get(service)
            )
            if code == 2:
                why = "it refuses its configuration (exit code 2): a restart would not help"
            if why is None:
                delay = min(up.restart_backoff_s * 2 ** (len(crashes) - 1), up.restart_backoff_max_s)
                self.restarts[key] = used + 1
                self.due[key] = now + delay
                self.say(
                    f"{replica.name} exited with code {code}: restart in {delay:.1f} s ({len(crashes)} of "
                    f"{up.crash_loop_limit} crashes within {up.crash_loop_window_s:g} s end the run); its last "
                    f"error: {last_error(replica.tail) or '-'}",
                    error=True,
                )
                continue
            if replica.tail:
                self.say(
                    f"last lines of {replica.name}:\n" + "\n".join(f"    {line}" for line in replica.tail), error=True
                )
            detail = f"exit code {code}; {why}; last error: {last_error(replica.tail) or '-'}"
            ended.append(Ended(*key, replica.name, code, removed=False, detail=detail))
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
