"""The bus's writes through a real lost reply: a proxy forwards the script call to Redis, Redis runs
it, the proxy drops the connection before the reply; the client's outage retry sends the same call
again. Each write takes effect once and the caller gets the first execution's replies."""

from __future__ import annotations

import asyncio
import hashlib
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import redis
from test_bus import make_trajectory

from streamrl.common.bus import COMMIT_LUA, Bus, Fence, Output, connect
from streamrl.common.consumer import encode_payload
from streamrl.common.streams import StreamNames
from streamrl.common.tx import TX_LUA

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
from redis_proxy import FaultProxy


def _sha(script: str) -> bytes:
    """What EVALSHA sends for ``script``: the proxy drops the reply to the call that holds it."""
    return hashlib.sha1(script.encode()).hexdigest().encode()


async def _through_proxy(redis_url: str, body: Any) -> Any:
    proxy = FaultProxy(urlparse(redis_url).port or 6379)
    bus = Bus(connect(proxy.listen("bus"), outage_s=10), maxlen=1000)
    try:
        return await body(bus, proxy)
    finally:
        await bus.redis.aclose()
        await asyncio.to_thread(proxy.close)


def test_a_tx_whose_reply_is_lost_runs_once(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    client.set(names.lease("singleton", "coordinator"), "me")

    async def body(bus: Bus, proxy: FaultProxy) -> tuple[list[Any], int]:
        bus.fence = Fence(names.lease("singleton", "coordinator"), "me")
        await bus.tx().set(names.state("warm"), 1).execute()  # the script is loaded: EVALSHA from here on
        proxy.drop_reply_to(_sha(TX_LUA))
        tx = bus.tx().require(names.state("batch_index"), equals=None).xadd(names.batches, make_trajectory(0))
        replies = await tx.incr(names.state("batch_index")).execute()
        return replies, len(proxy.lost)

    (entry_id, index), dropped = asyncio.run(_through_proxy(redis_url, body))
    assert dropped == 1, "the proxy did not lose the reply"
    assert index == 1 and client.get(names.state("batch_index")) == b"1"
    assert [i for i, _ in client.xrange(names.batches)] == [entry_id]  # one batch, the one the caller saw


def test_a_commit_whose_reply_is_lost_writes_once(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(names.trajectories, "reward", id="0", mkstream=True)
    entry = client.xadd(names.trajectories, encode_payload(make_trajectory(0))).decode()
    client.xreadgroup("reward", "c", {names.trajectories: ">"})

    async def body(bus: Bus, proxy: FaultProxy) -> tuple[bool, bool, int]:
        await bus.commit([])  # the script is loaded: EVALSHA from here on
        proxy.drop_reply_to(_sha(COMMIT_LUA))
        out = [Output(stream=names.scored, message=make_trajectory(0))]
        acked = await bus.commit(out, ack_stream=names.trajectories, ack_group="reward", ack_entry=entry)
        proxy.drop_reply_to(_sha(COMMIT_LUA))
        no_entry = await bus.commit([Output(stream=names.prompts, message=make_trajectory(1))])
        return acked, no_entry, len(proxy.lost)

    acked, no_entry, dropped = asyncio.run(_through_proxy(redis_url, body))
    assert dropped == 2
    assert not acked and not no_entry  # the re-sent call found its work done: reported as a duplicate
    assert client.xlen(names.scored) == 1 and client.xlen(names.prompts) == 1
    assert client.xpending(names.trajectories, "reward")["pending"] == 0
