"""A command Redis refuses (an ACL without the permission, a command it does not know) stops a service
with that reason in one line - never as "lost redis", which sends an operator after the network."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis as syncredis

from streamrl.common.lifecycle import ServiceConfig, ServiceContext, service_main


@pytest.fixture
def user_without_flushall(redis_url: str) -> Iterator[str]:
    """A Redis user allowed everything but FLUSHALL; its URL."""
    admin = syncredis.Redis.from_url(redis_url)
    user, password = f"probe-{uuid.uuid4().hex[:8]}", "pw"
    admin.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"], commands=["+@all", "-flushall"]
    )
    parts = urlsplit(redis_url)
    yield f"redis://{user}:{password}@{parts.hostname}:{parts.port}/0"
    admin.acl_deluser(user)
    admin.close()


def _stop_line(service_main_call: int, err: str) -> str:
    lines = [line for line in err.splitlines() if "ERROR" in line]
    assert service_main_call == 1, err
    assert lines, err
    return lines[-1]


def test_a_refused_permission_is_said_as_such(
    tmp_path: Path, user_without_flushall: str, capfd: pytest.CaptureFixture[str], root_logging: None
) -> None:
    async def run(config: ServiceConfig, ctx: ServiceContext) -> None:
        await ctx.bus.redis.flushall()

    argv = [f"--redis.url={user_without_flushall}", f"--run_dir={tmp_path}", "--run_id=acl", "--instance=probe-0"]
    code = service_main("probe", ServiceConfig, run, argv)
    out, err = capfd.readouterr()
    line = _stop_line(code, out + err)
    assert "lost redis" not in line
    assert "NOPERM" in line and "flushall" in line.lower() and "ACL" in line


def test_an_unknown_command_is_said_as_such(
    tmp_path: Path, redis_url: str, capfd: pytest.CaptureFixture[str], root_logging: None
) -> None:
    async def run(config: ServiceConfig, ctx: ServiceContext) -> None:
        await ctx.bus.redis.execute_command("NOSUCHCOMMAND")

    argv = [f"--redis.url={redis_url}", f"--run_dir={tmp_path}", "--run_id=unknown", "--instance=probe-0"]
    code = service_main("probe", ServiceConfig, run, argv)
    out, err = capfd.readouterr()
    line = _stop_line(code, out + err)
    assert "lost redis" not in line
    assert "refused" in line and "NOSUCHCOMMAND" in line.upper()
