"""The fault proxy itself, against a real redis-server: it frames RESP, names commands, passes
traffic through, and a lost reply is what the suite needs it to be (the command ran, the client
re-sends it: a plain INCR runs twice)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
import redis as syncredis
from redis_proxy import FaultProxy, LoseEachKind, LoseRandom
from resp import ScriptNames, command_kind, key_shape, next_frame, parse_command

from streamrl.common.bus import connect
from streamrl.ops.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]


def test_next_frame_finds_the_end_of_each_resp_type() -> None:
    cases = [
        b"+OK\r\n",
        b"-ERR x\r\n",
        b":12\r\n",
        b"$3\r\nabc\r\n",
        b"$-1\r\n",
        b"*-1\r\n",
        b"*2\r\n$1\r\na\r\n*1\r\n:1\r\n",
        b"%1\r\n+k\r\n:2\r\n",
        b"_\r\n",
        b",1.5\r\n",
        b"|1\r\n+a\r\n+b\r\n:7\r\n",
    ]
    for frame in cases:
        assert next_frame(frame + b"+next\r\n") == len(frame), frame
        assert next_frame(frame[:-1]) is None, frame
    with pytest.raises(ValueError, match="not RESP"):
        next_frame(b"?huh\r\n")


def test_parse_command_and_its_kind() -> None:
    wire = b"*4\r\n$4\r\nXADD\r\n$27\r\nstreamrl:{r1}:batches:x-1-2\r\n$1\r\n*\r\n$1\r\nd\r\n"
    args, end = parse_command(wire + b"*1\r\n") or ([], 0)
    assert end == len(wire) and args[0] == b"XADD"
    scripts = ScriptNames()
    assert command_kind(args, scripts) == "XADD batches:*"
    assert key_shape(b"streamrl:{r1}:hb:rollout:rollout-0") == "hb:rollout:*"
    assert key_shape(b"streamrl:{r1}:state:policy_version") == "state:policy_version"
    body = b"-- renew\nreturn 1"
    sha = hashlib.sha1(body).hexdigest().encode()
    assert command_kind([b"EVALSHA", sha, b"1", b"streamrl:{r}:lease:x"], scripts).startswith("EVALSHA script")
    assert command_kind([b"SCRIPT", b"LOAD", body], scripts) == "SCRIPT LOAD"
    assert "renew" in command_kind([b"EVALSHA", sha, b"1", b"streamrl:{r}:lease:x"], scripts)


def test_the_code_base_scripts_are_named() -> None:
    names = ScriptNames.from_sources(ROOT / "libs", ROOT / "services")
    assert any(n.endswith(".COMMIT_LUA") for n in names.names.values()), names.names


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    srv = RedisServer(tmp_path / "redis", appendonly=False).start()
    yield srv
    srv.stop()


def test_a_lost_reply_makes_a_plain_incr_run_twice(server: RedisServer) -> None:
    """The bug class of issue 26, reproduced through the proxy with the services' own client."""
    proxy = FaultProxy(server.port)
    try:
        url = proxy.listen("svc")

        async def go() -> tuple[int, int, bytes | None]:
            client = connect(url, outage_s=10)
            await client.set("k", "v")
            await client.incr("n")  # before the policy: passes
            proxy.set_policy(LoseEachKind("svc", gap_s=0))
            reply = await client.incr("n")  # its reply is lost once; the retry runs it again
            value = await client.get("k")
            await client.aclose()
            return reply, len(proxy.lost), value

        reply, lost, value = asyncio.run(go())
        direct = syncredis.Redis(port=server.port)
        assert lost == 1 and proxy.lost[0].kind == "INCRBY n"
        assert int(direct.get("n") or 0) == 3, "the lost INCR ran, and its re-send ran again"
        assert reply == 3 and value == b"v"
        writes = proxy.writes_by_service()["svc"]
        assert "INCRBY n" in writes and "SET k" in writes and not any(k.startswith("GET") for k in writes)
    finally:
        proxy.close()


def test_transactions_are_one_kind_and_random_loss_passes_reads(server: RedisServer) -> None:
    proxy = FaultProxy(server.port)
    try:
        url = proxy.listen("svc")

        async def go() -> None:
            client = connect(url, outage_s=10)
            async with client.pipeline(transaction=True) as pipe:
                pipe.incr("a").rpush("l", "x")
                await pipe.execute()
            proxy.set_policy(LoseRandom(1.0))
            for _ in range(5):
                await client.get("a")  # reads are never lost
            await client.aclose()

        asyncio.run(go())
        assert "MULTI[INCRBY a, RPUSH l]" in proxy.writes_by_service()["svc"]
        assert not proxy.lost
    finally:
        proxy.close()
