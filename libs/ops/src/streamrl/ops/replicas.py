"""What a backend of ``streamrl up`` is, and the process helpers every backend uses.

* :class:`Replicas`: start, drain and watch the replicas of each service (the launcher's only view of
  a backend); :class:`Ended`: a replica gone for good. Backends: :mod:`streamrl.ops.local_backend`
  (child processes) and :mod:`streamrl.ops.ray_backend` (Ray actors).
* :func:`service_command` / :func:`child_env`: the command line and environment of one replica, the
  same on every backend; :func:`die_with_parent` / :func:`signal_group`: no replica outlives its
  parent, and a stop reaches its whole process group.

The launcher (:mod:`streamrl.ops.launcher`) and the backends import this module; it imports none of
them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

Say = Callable[..., None]
"""How a backend reports: ``say(text, error=False)`` (the launcher prints it, prefixed)."""


@dataclass(frozen=True)
class Ended:
    """A replica gone for good: no restart follows."""

    service: str
    index: int
    name: str
    code: int | None
    """Exit code of the service process (None: not known, e.g. its Ray actor died)."""
    removed: bool
    """It was drained on purpose (scaled down)."""
    detail: str = ""
    """Why, when the exit code does not say it."""


class Replicas(Protocol):
    """What the launcher needs of a backend: start, drain and watch the replicas of each service."""

    def start(self, service: str, index: int) -> None: ...

    def drain(self, service: str, index: int) -> None:
        """Remove a replica: SIGTERM its service, SIGKILL after ``grace_s``; reported by :meth:`poll` once gone."""

    def poll(self) -> list[Ended]:
        """Replicas gone for good since the last call; restarts what may restart."""

    def active(self, service: str) -> list[int]:
        """Indices of replicas running or about to (re)start, not being drained."""

    def occupied(self, service: str) -> list[int]:
        """Indices not free: active ones and those still draining."""

    def stop_all(self) -> None:
        """SIGTERM every replica, wait ``grace_s``, SIGKILL the rest."""


def die_with_parent() -> None:
    """In the child: get SIGTERM if its parent dies (no orphans even on SIGKILL of the launcher or actor).

    The signal follows the death of the *thread* that started the child: start it from a thread that
    lives as long as the child (the main thread, or one that waits for it)."""
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


def service_command(python: str, service: str, recipe: str, overrides: list[str], instance: str) -> list[str]:
    """The command line of one replica (the Redis URL and keys travel in its environment, never here: ``ps``
    shows command lines)."""
    return [python, "-m", "streamrl.ops.cli", service, recipe, *overrides, f"--instance={instance}"]


def signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
