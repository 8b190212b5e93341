"""The embedded redis-server of ``streamrl up`` started for real: it reports the binary it found and its version,
and a stop leaves no process and no open pipe behind."""

from __future__ import annotations

from pathlib import Path

from streamrl.ops.redis_server import RedisServer, find_redis_server


def test_started_server_reports_its_binary_and_version(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=False).start()
    try:
        assert server.binary == find_redis_server()
        assert server.version.startswith("Redis server v=")
    finally:
        server.stop()


def test_stop_ends_the_server_and_closes_its_pipe(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=False).start()
    proc = server.proc
    assert proc is not None and proc.stderr is not None
    server.stop()
    assert proc.returncode is not None, "redis-server still runs"
    assert proc.stderr.closed, "the stderr pipe of redis-server is left open (a ResourceWarning at collection)"
    server.stop()  # a second stop changes nothing
