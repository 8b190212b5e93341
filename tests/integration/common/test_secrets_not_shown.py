"""A service started with a password in its Redis URL shows the password nowhere: not in a log or
``--dry-run`` line, not in any file of its run directory; it still connects with the real URL."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as syncredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from streamrl.common.lifecycle import ServiceConfig, ServiceContext, service_main
from streamrl.ops.redis_server import find_redis_server, free_port

PASSWORD = "s3cret"


@pytest.fixture
def password_redis_url(tmp_path: Path) -> Iterator[str]:
    """A real redis-server that refuses clients without ``PASSWORD``."""
    port = free_port()
    proc = subprocess.Popen(
        [
            find_redis_server(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--requirepass",
            PASSWORD,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    client = syncredis.Redis.from_url(url, socket_timeout=1)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except syncredis.ConnectionError:
                proc.poll()
                assert proc.returncode is None, "redis-server exited at start"
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not answer")
        with pytest.raises(syncredis.AuthenticationError):  # the password is really required
            syncredis.Redis(port=port, socket_timeout=1, retry=Retry(NoBackoff(), 0)).ping()
        yield url
    finally:
        client.close()
        proc.terminate()
        proc.wait(5)


def _files_with_password(run_dir: Path) -> list[str]:
    return [str(p) for p in run_dir.rglob("*") if p.is_file() and PASSWORD.encode() in p.read_bytes()]


def test_service_run_shows_no_password(
    tmp_path: Path, password_redis_url: str, capfd: pytest.CaptureFixture[str], root_logging: None
) -> None:
    run_dir = tmp_path / "run"
    connected: list[bool] = []

    async def run(config: ServiceConfig, ctx: ServiceContext) -> None:
        assert config.redis.url == password_redis_url  # the service connects with the real URL
        connected.append(bool(await ctx.bus.redis.ping()))
        logging.getLogger("probe").info("probe connected")

    argv = [f"--redis.url={password_redis_url}", f"--run_dir={run_dir}", "--run_id=redact", "--instance=probe-0"]
    assert service_main("probe", ServiceConfig, run, argv) == 0
    assert connected == [True]
    assert service_main("probe", ServiceConfig, run, [*argv, "--dry-run"]) == 0

    out, err = capfd.readouterr()
    lines = (out + err).splitlines()
    config_lines = [line for line in lines if "probe config:" in line]
    assert config_lines and all("redis://:***@127.0.0.1:" in line for line in config_lines)
    assert "probe connected" in err
    assert '"url": "redis://:***@127.0.0.1:' in out  # --dry-run printed the config, masked
    assert [line for line in lines if PASSWORD in line] == []
    saved = (run_dir / "config.probe.json").read_text()
    assert '"url": "redis://:***@127.0.0.1:' in saved
    assert _files_with_password(run_dir) == []
