"""The learner's reads in a run with lanes (:mod:`streamrl.learner.rl.lanes`): a lane's Redis going down while a
joined batch is read is waited out, like the home's, and the batch is read whole once it is back - never
skipped; a batch's payloads in the lanes go with the learner's acknowledgement, and a deposed learner's
acknowledgement only gives them a time to live. Real redis-servers: the home and lane 0 on one, lane 1 on its own (AOF), stopped and restarted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from streamrl.common.batch_payloads import fetch_batch, manifest_of
from streamrl.common.bus import Bus, connect
from streamrl.common.codec import encode
from streamrl.common.config import RedisConfig
from streamrl.common.lanes import LanesConfig, lane_names
from streamrl.common.lease import LeaseLostError
from streamrl.common.messages import ScoredTrajectory, Tensor, TrainingBatch, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.common.tx import Fence
from streamrl.learner.rl.lanes import close_lanes, connect_lanes
from streamrl.learner.rl.ledger import LearnerLedger
from streamrl.ops.redis_server import RedisServer


def sample(group: int, index: int) -> ScoredTrajectory:
    traj = Trajectory(
        id=f"p{group}/{index}",
        group_id=f"p{group}",
        group_index=index,
        group_size=2,
        prompt_ids=Tensor.from_list([1, 2], "int32"),
        response_ids=Tensor.from_list([7, 8, 9], "int32"),
        logprobs=Tensor.from_list([-0.5] * 3, "float32"),
        loss_mask=Tensor.from_list([1] * 3, "uint8"),
    )
    return ScoredTrajectory(trajectory=traj, reward=float(index))


def test_a_lanes_redis_down_mid_read_is_waited_out_and_the_batch_read_whole(
    tmp_path: Path, redis_url: str, run_id: str
) -> None:
    lane1 = RedisServer(tmp_path / "lane1", appendfsync="always").start()
    servers = [lane1]
    samples = [sample(g, i) for g in range(4) for i in range(2)]
    batch = TrainingBatch(id="batch-0", index=0, samples=samples, policy_version=0, staleness=[0] * len(samples))
    lanes = [lane_names(run_id, 0), lane_names(run_id, 1)]
    keys = [lanes[s.trajectory.group_index].batched_samples("batch-0", s.trajectory.group_id) for s in samples]
    manifest = manifest_of(batch, keys, [len(encode(s)) for s in samples])

    async def main() -> TrainingBatch:
        home = connect(redis_url, outage_s=30)
        config = LanesConfig(count=2, urls=[redis_url, lane1.url])
        clients = await connect_lanes(home, run_id, config, RedisConfig(url=redis_url, outage_s=30))
        assert clients.clients[0] is home and clients.clients[1] is not home  # lane 0 shares the home's client
        try:
            for key, s in zip(keys, samples, strict=True):
                await clients.for_key(key).hset(key, s.trajectory.id, encode(s))
            lane1.stop()  # lane 1's Redis goes down before the read
            reading = asyncio.create_task(fetch_batch(clients, manifest, max_reply_bytes=2**20))
            await asyncio.sleep(2.0)
            assert not reading.done()  # waiting for lane 1, not skipping the batch
            servers.append(RedisServer(tmp_path / "lane1", port=lane1.port, appendfsync="always").start())
            return await asyncio.wait_for(reading, 30)
        finally:
            await close_lanes(clients)
            await home.aclose()

    try:
        assert asyncio.run(main()) == batch  # whole, in order, after the outage
    finally:
        for server in servers:
            server.stop()


def test_a_lanes_payloads_go_with_the_ack_and_a_deposed_learners_ack_only_gives_them_a_time_to_live(
    tmp_path: Path, redis_url: str, run_id: str
) -> None:
    lane1 = RedisServer(tmp_path / "lane1", appendonly=False).start()
    home_names = StreamNames(run_id)
    payloads = [lane_names(run_id, 0).batched_samples("batch-0", "g"), lane_names(run_id, 1).batched_samples("b", "g")]
    lease = home_names.lease("singleton", "learner")

    async def main() -> tuple[list[int], list[int]]:
        home = connect(redis_url)
        config = LanesConfig(count=2, urls=[redis_url, lane1.url])
        clients = await connect_lanes(home, run_id, config, RedisConfig(url=redis_url))
        bus = Bus(home, payload_orphan_ttl_s=600)
        bus.fence = Fence(lease, "me")
        ledger = LearnerLedger(bus, home_names)
        try:
            for key in payloads:
                await clients.for_key(key).set(key, b"payload")
            entry = (await home.xadd(home_names.batches, {"d": b"joined"})).decode()
            await home.xgroup_create(home_names.batches, "learner", id="0")
            await home.xreadgroup("learner", "learner", {home_names.batches: ">"})
            await home.set(lease, "another learner")  # deposed: its fenced transaction is refused
            with pytest.raises(LeaseLostError):
                await ledger.ack(home_names.batches, [entry], ["batch-0"], 0, 1, payloads, clients)
            ttls = [await clients.for_key(k).ttl(k) for k in payloads]
            await home.set(lease, "me")
            await ledger.ack(home_names.batches, [entry], ["batch-0"], 0, 1, payloads, clients)
            return ttls, [await clients.for_key(k).exists(k) for k in payloads]
        finally:
            await close_lanes(clients)
            await home.aclose()

    try:
        ttls, left = asyncio.run(main())
    finally:
        lane1.stop()
    assert all(0 < ttl <= 600 for ttl in ttls)  # kept for a successor's replay, never leaked
    assert left == [0, 0]  # the learner's ack deletes them in both lanes
