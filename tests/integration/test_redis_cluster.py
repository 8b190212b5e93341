"""The bus on Redis Cluster: every key of a run carries the run's hash tag, and the commit script
declares the keys it touches, so a consumer's atomic commits work on a cluster node (which refuses
a script or transaction whose keys span slots). The whole pipeline on a cluster is the
``on-redis-cluster`` case of tests/e2e/test_demo_pipeline.py."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ResponseError
from test_bus import make_trajectory

from streamrl.common.bus import Bus, Output, connect
from streamrl.common.codec import decode
from streamrl.common.config import ConsumerConfig
from streamrl.common.consumer import ConsumerLoop
from streamrl.common.messages import ScoredTrajectory, Trajectory
from streamrl.common.streams import StreamNames


class _UntaggedNames(StreamNames):
    """The key names before the hash tag (``streamrl:run:...``): a run's keys spread over slots."""

    def _key(self, *parts: str) -> str:
        return ":".join(("streamrl", self.run_id, *parts))


async def _consume(url: str, names: StreamNames, count: int) -> list[str]:
    """Publish ``count`` trajectories, score them through a consumer loop (commits batched into one
    script call with a pending check, an XADD, an HSET and an XACK each); the scored ids."""
    bus = Bus(connect(url))
    try:
        for i in range(count):
            await bus.publish(names.trajectories, make_trajectory(i))

        async def score(traj: Trajectory) -> list[Output]:
            scored = ScoredTrajectory(trajectory=traj, reward=1.0)
            return [
                Output(stream=names.scored, message=scored),
                Output(key=names.group_buffer(traj.group_id), field=traj.id, message=scored),
            ]

        stop = asyncio.Event()
        loop: ConsumerLoop[Trajectory] = ConsumerLoop(
            bus,
            names,
            stream=names.trajectories,
            group="reward",
            consumer="r-0",
            handler=score,
            message_type=Trajectory,
            config=ConsumerConfig(max_deliveries=1, retry_delay_s=0.0),
        )
        await asyncio.wait_for(loop.run(stop, burst=True), timeout=30)
        assert loop.stats.failed == 0, loop.stats.last_error
        return [decode(f[b"d"], ScoredTrajectory).trajectory.id for _, f in await bus.redis.xrange(names.scored)]
    finally:
        await bus.redis.aclose()


def test_consumer_commits_work_on_a_cluster_node(redis_cluster_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    assert names.scored == f"streamrl:{{{run_id}}}:scored"
    assert sorted(asyncio.run(_consume(redis_cluster_url, names, 20))) == sorted(f"g{i}/0" for i in range(20))


def test_untagged_names_are_refused_by_the_cluster(redis_cluster_url: str, run_id: str) -> None:
    """What the hash tag fixes: with the old names one commit (consume an entry, publish its output)
    spans slots, and the cluster refuses it."""

    async def commit(names: StreamNames) -> None:
        bus = Bus(connect(redis_cluster_url))
        try:
            scored = ScoredTrajectory(trajectory=make_trajectory(0), reward=1.0)
            await bus.redis.xgroup_create(names.trajectories, "reward", id="0", mkstream=True)
            await bus.commit(
                [Output(stream=names.scored, message=scored)],
                ack_stream=names.trajectories,
                ack_group="reward",
                ack_entry="0-1",
            )
        finally:
            await bus.redis.aclose()

    asyncio.run(commit(StreamNames(run_id)))
    with pytest.raises(ResponseError, match=r"CROSSSLOT|same slot"):
        asyncio.run(commit(_UntaggedNames(run_id)))
