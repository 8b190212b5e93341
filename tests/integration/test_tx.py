"""The bus's write path against a real redis-server: transactions (atomic, fenced, preconditions,
idempotent against a re-send) and commits (written only while their entry is pending, fenced)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import ResponseError

from streamrl.common.bus import Bus, Fence, Output, PreconditionFailed, connect
from streamrl.common.consumer import encode_payload
from streamrl.common.lease import LeaseLostError
from streamrl.common.messages import Heartbeat
from streamrl.common.streams import StreamNames
from streamrl.ops.redis_server import RedisServer


def _beat(i: int = 0) -> Heartbeat:
    return Heartbeat(service="s", instance=f"i{i}", pid=i, ts=0.0)


def _with_bus(url: str, body: Callable[[Bus], Awaitable[Any]], outage_s: float = 60.0) -> Any:
    async def main() -> Any:
        bus = Bus(connect(url, outage_s=outage_s), maxlen=1000)
        try:
            return await body(bus)
        finally:
            await bus.redis.aclose()

    return asyncio.run(main())


def test_tx_runs_its_commands_once_and_replies_like_redis_py(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    counter, stream, hash_ = names.state("n"), names.batches, names.state("h")

    async def body(bus: Bus) -> list[Any]:
        tx = bus.tx().xadd(stream, _beat()).incr(counter).incrby(counter, 5).set(names.state("s"), "v")
        tx.hset(hash_, "f", "1").hincrby(hash_, "f", 2).call("GET", names.state("missing"))
        tx.rpush(names.state("l"), "a", "b").call("LRANGE", names.state("l"), 0, -1).zadd(names.state("z"), {"m": 1.5})
        return await tx.execute()

    entry, one, six, ok, added, three, missing, pushed, items, zadded = _with_bus(redis_url, body)
    client = redis.Redis.from_url(redis_url)
    assert isinstance(entry, bytes) and client.xrange(stream)[0][0] == entry
    assert (one, six, ok, added, three, missing, pushed, items, zadded) == (1, 6, True, 1, 3, None, 2, [b"a", b"b"], 1)
    assert client.get(counter) == b"6" and client.hget(hash_, "f") == b"3"


def test_a_resent_tx_returns_the_first_replies_without_running_again(redis_url: str, run_id: str) -> None:
    """What the client's outage retry does after a lost reply: the same script call, sent again."""
    names = StreamNames(run_id)

    async def body(bus: Bus) -> tuple[Any, Any]:
        tx = bus.tx().xadd(names.batches, _beat()).incr(names.state("batch_index"))
        keys, args = tx.script_args(secrets.token_hex(12))
        first = await bus.run_tx_script(keys, args)
        again = await bus.run_tx_script(keys, args)
        return first, again

    first, again = _with_bus(redis_url, body)
    client = redis.Redis.from_url(redis_url)
    assert first == again
    assert client.xlen(names.batches) == 1 and client.get(names.state("batch_index")) == b"1"
    once = [k for k in client.scan_iter(f"streamrl:{{{run_id}}}:once:*")]
    assert len(once) == 1 and 0 < client.pttl(once[0]) <= 120_000  # twice redis.outage_s (60 s)


def test_a_failed_precondition_writes_nothing(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    client.set(names.state("batch_index"), 3)

    async def body(bus: Bus) -> None:
        await bus.tx().require(names.state("batch_index"), equals=3).require(names.state("new"), equals=None).execute()
        with pytest.raises(PreconditionFailed) as wrong:
            await (
                bus.tx()
                .require(names.state("batch_index"), equals=2)
                .xadd(names.batches, _beat())
                .incr(names.state("batch_index"))
                .execute()
            )
        assert (wrong.value.key, wrong.value.wanted, wrong.value.found) == (names.state("batch_index"), 2, b"3")
        assert "wanted 2, found b'3'" in str(wrong.value)
        with pytest.raises(PreconditionFailed, match="wanted absent"):
            await bus.tx().require(names.state("batch_index"), equals=None).incr(names.state("batch_index")).execute()

    _with_bus(redis_url, body)
    assert client.get(names.state("batch_index")) == b"3" and client.xlen(names.batches) == 0


def test_a_failing_command_is_raised_after_the_others_ran(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    client.set(names.state("str"), "x")

    async def body(bus: Bus) -> None:
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await bus.tx().hset(names.state("str"), "f", 1).incr(names.state("n")).execute()

    _with_bus(redis_url, body)
    assert client.get(names.state("n")) == b"1"  # as MULTI/EXEC: the other commands ran


def test_a_deposed_holder_writes_nothing(redis_url: str, run_id: str) -> None:
    """The fence: a lease key holding another token refuses every commit and transaction of this bus;
    a key that holds nothing (expired) or this process's token lets them through."""
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    lease = names.lease("singleton", "coordinator")
    client.xgroup_create(names.scored, "coordinator", id="0", mkstream=True)
    entry = client.xadd(names.scored, encode_payload(_beat())).decode()
    client.xreadgroup("coordinator", "c", {names.scored: ">"})
    client.set(lease, "coordinator@other-host:42/abcd")

    async def body(bus: Bus) -> None:
        bus.fence = Fence(lease, "coordinator@this-host:7/ef01")
        with pytest.raises(LeaseLostError, match="held by coordinator@other-host:42"):
            await bus.tx().xadd(names.batches, _beat()).incr(names.state("batch_index")).execute()
        with pytest.raises(LeaseLostError, match="held by coordinator@other-host:42"):
            await bus.commit(
                [Output(stream=names.batches, message=_beat())],
                ack_stream=names.scored,
                ack_group="coordinator",
                ack_entry=entry,
            )
        with pytest.raises(LeaseLostError):
            await bus.publish(names.dead, _beat())
        assert client.xlen(names.batches) == 0 and client.get(names.state("batch_index")) is None
        assert client.xpending(names.scored, "coordinator")["pending"] == 1  # not acknowledged either
        client.delete(lease)  # expired, nobody took it: the write goes on
        await bus.tx().incr(names.state("batch_index")).execute()
        client.set(lease, "coordinator@this-host:7/ef01")  # held by this process
        assert await bus.commit(
            [Output(stream=names.batches, message=_beat())],
            ack_stream=names.scored,
            ack_group="coordinator",
            ack_entry=entry,
        )

    _with_bus(redis_url, body)
    assert client.get(names.state("batch_index")) == b"1" and client.xlen(names.batches) == 1


def test_a_commit_writes_only_while_its_entry_is_pending(redis_url: str, run_id: str) -> None:
    """A re-sent commit (lost reply) or a late one (its entry handled by another consumer) is a duplicate."""
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(names.trajectories, "reward", id="0", mkstream=True)
    first, second = (client.xadd(names.trajectories, encode_payload(_beat(i))).decode() for i in range(2))
    client.xreadgroup("reward", "slow", {names.trajectories: ">"})

    async def body(bus: Bus) -> list[Any]:
        out = [Output(stream=names.scored, message=_beat())]
        args = bus.commit_args(out, ack_stream=names.trajectories, ack_group="reward", ack_entry=first)
        sent = await bus.run_commits([args])
        resent = await bus.run_commits([args])  # the client's retry after the reply was lost
        client.xclaim(names.trajectories, "reward", "fast", 0, [second])
        client.xack(names.trajectories, "reward", second)  # "fast" handled the reclaimed copy
        late = await bus.commit(out, ack_stream=names.trajectories, ack_group="reward", ack_entry=second)
        no_entry = bus.commit_args(out)  # no input entry: a once key guards the re-send
        return [*sent, *resent, late, *(await bus.run_commits([no_entry])), *(await bus.run_commits([no_entry]))]

    assert _with_bus(redis_url, body) == [1, 0, False, 1, 0]
    assert client.xlen(names.scored) == 2  # the first commit and the no-entry one, once each
    assert client.xpending(names.trajectories, "reward")["pending"] == 0


def test_tx_and_commits_work_on_a_cluster_node(redis_cluster_url: str, run_id: str) -> None:
    names = StreamNames(run_id)

    async def body(bus: Bus) -> list[Any]:
        bus.fence = Fence(names.lease("singleton", "coordinator"), "me")
        await bus.commit([Output(stream=names.prompts, message=_beat())])
        return (
            await bus.tx()
            .require(names.state("i"), equals=None)
            .xadd(names.batches, _beat())
            .incr(names.state("i"))
            .execute()
        )

    assert _with_bus(redis_cluster_url, body)[1] == 1


def test_a_full_redis_is_ridden_out_like_an_outage(
    tmp_path: Path, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """maxmemory reached under noeviction: the writes wait (the command did not run) and go through
    once memory is freed, with one WARNING and one INFO line."""
    server = RedisServer(tmp_path, appendonly=False).start()
    names = StreamNames(run_id)
    admin = redis.Redis.from_url(server.url)
    try:
        admin.set("ballast", b"x" * 4_000_000)
        time.sleep(0.5)  # the 4 MB query buffer of that SET is freed: used_memory settles
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", used - 1_000_000)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            admin.set("k", "v")

        async def body(bus: Bus) -> list[Any]:
            async def free_later() -> None:
                await asyncio.sleep(1.0)
                admin.delete("ballast")

            freer = asyncio.create_task(free_later())
            written = await bus.tx().incr(names.state("n")).execute()
            await bus.commit([Output(stream=names.prompts, message=_beat())])
            await freer
            return written

        caplog.set_level("INFO", logger="streamrl.common.bus")
        assert _with_bus(server.url, body, outage_s=20) == [1]
        assert admin.get(names.state("n")) == b"1" and admin.xlen(names.prompts) == 1
        full = [r for r in caplog.records if "redis is full" in r.message]
        back = [r for r in caplog.records if "accepts writes again" in r.message]
        assert len(full) == 1 and full[0].levelname == "WARNING" and len(back) == 1
    finally:
        admin.close()
        server.stop()
