"""Lanes on two redis-servers: each lane's coordinator issues only its shard of the dataset, lane 0's also
joins the lanes' batches into the one the learner trains (:mod:`streamrl.coordinator.joining`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
import redis.asyncio as aioredis
from coordinator_fakes import sample

from streamrl.common.batch_payloads import load_manifest
from streamrl.common.bus import Bus, connect
from streamrl.common.codec import decode, encode
from streamrl.common.config import ConsumerConfig
from streamrl.common.lanes import lane_names, lane_of_key
from streamrl.common.messages import (
    BATCH_SKIPPED,
    BatchManifest,
    DeadLetter,
    PromptWorkItem,
    SampleRef,
    ScoredRecord,
    Tensor,
    Trajectory,
    WeightsPublished,
)
from streamrl.common.payloads import record_of
from streamrl.common.streams import StreamNames
from streamrl.common.tx import TX_LUA
from streamrl.common.weights.auth import KEY_ENV, sign
from streamrl.coordinator.batches import BatchBuilder, store_parts
from streamrl.coordinator.dead_letters import LostBatch, what_was_lost
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.joining import Joiner, Lane
from streamrl.coordinator.state import RunState
from streamrl.ops.redis_server import RedisServer


@pytest.fixture
def second_redis(tmp_path: Path) -> Iterator[str]:
    """A second real redis-server: lane 1's."""
    server = RedisServer(tmp_path / "lane1-redis", appendonly=False).start()
    yield server.url
    server.stop()


def start(
    recipe: Path, run_id: str, lane: int, urls: list[str], *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """The coordinator of ``lane`` as a process (two lanes at ``urls``); its output goes to ``proc.log_path``."""
    cmd = [
        sys.executable,
        "-m",
        "streamrl.coordinator",
        str(recipe),
        f"--run_id={run_id}",
        "--lanes.count=2",
        f"--lanes.urls={json.dumps(urls)}",
        "--coordinator.eval.dataset=null",
        *extra,
    ]
    log = tempfile.NamedTemporaryFile(prefix=f"coordinator-lane{lane}-", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STREAMRL_LANE": str(lane), **(env or {})}
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name  # type: ignore[attr-defined]
    return proc


def stop(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return Path(proc.log_path).read_text()  # type: ignore[attr-defined]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the coordinator exited ({proc.returncode}) waiting for {what}: {stop(proc)[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


WEIGHTS_KEY = "a-weights-key-of-this-run"


def ready(version: int = 0, signed_for: str | None = None) -> dict[bytes, bytes]:
    """A learner's weights event (signed for run ``signed_for`` with :data:`WEIGHTS_KEY` when given)."""
    event = WeightsPublished(
        version=version, step=version, batch_id="", checksum="0", num_bytes=0, num_buckets=0, endpoint="tcp://x:1"
    )
    if signed_for is not None:
        event = sign(event, WEIGHTS_KEY.encode(), run_id=signed_for)
    return {b"d": encode(event)}


def test_a_lane_coordinator_issues_only_its_shard_of_the_dataset(
    tiny_task: Path, tmp_path: Path, redis_url: str, second_redis: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(40)))
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    lane1 = redis.Redis.from_url(second_redis)
    names = lane_names(run_id, 1)
    lane1.xadd(names.weights, ready())
    proc = start(
        recipe,
        run_id,
        1,
        [redis_url, second_redis],
        f"--coordinator.dataset.path={data}",
        "--coordinator.dataset.shuffle=false",
    )
    try:
        # prompts_per_step 4 over 2 lanes: lane batches of 2 groups; batch 0 and one prefetched = 4 prompts
        wait_for(lambda: lane1.xlen(names.prompts) >= 4, 120, "lane 1's prompts", proc)
        time.sleep(1.0)
        issued = [decode(f[b"d"], PromptWorkItem) for _, f in lane1.xrange(names.prompts)]
        assert [p.prompt_text for p in issued] == ["1+1=", "3+1=", "5+1=", "7+1="]
        assert [p.id for p in issued] == ["p1", "p3", "p5", "p7"]
        assert [p.policy_version for p in issued] == [0, 0, 1, 1]
        assert lane1.get(names.state("cursor")) == b"4"
        assert not redis.Redis.from_url(redis_url).keys(f"*{run_id}/lane1*"), "lane 1 wrote to the home Redis"
        # each lane's coordinator saves its own resolved config: the lanes share the run_dir
        assert (tmp_path / "run" / "config.coordinator.lane1.json").exists()
        assert not (tmp_path / "run" / "config.coordinator.json").exists()
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out[-3000:]
    # restarted, it resumes its own shard where it stopped (version 1 lets two more groups in)
    args = (f"--coordinator.dataset.path={data}", "--coordinator.dataset.shuffle=false")
    proc = start(recipe, run_id, 1, [redis_url, second_redis], *args)
    try:
        lane1.xadd(names.weights, ready(1))
        wait_for(lambda: lane1.xlen(names.prompts) >= 6, 120, "lane 1's prompts after its restart", proc)
        time.sleep(1.0)
        issued = [decode(f[b"d"], PromptWorkItem) for _, f in lane1.xrange(names.prompts)]
        assert [p.id for p in issued] == ["p1", "p3", "p5", "p7", "p9", "p11"]
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out[-3000:]


def test_a_batch_size_that_does_not_split_over_the_lanes_is_refused_naming_both(
    tiny_task: Path, tmp_path: Path, redis_url: str, second_redis: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    proc = start(recipe, run_id, 0, [redis_url, second_redis], "--coordinator.prompts_per_step=3")
    proc.wait(timeout=60)
    out = stop(proc)
    assert proc.returncode == 2, out[-3000:]
    assert "prompts_per_step = 3" in out and "lanes.count = 2" in out


# -- the joiner, in process, on the home Redis (also lane 0's) and lane 1's --------------------------------------


def lane_manifest(names: StreamNames, index: int, groups: list[str], *, version: int = 0) -> BatchManifest:
    """Lane batch ``index`` as a lane coordinator publishes it: two samples per group, payloads under the batch."""
    batch_id = f"batch-{index}"
    refs = [
        SampleRef(
            trajectory_id=f"{g}/{i}",
            group_id=g,
            key=names.batched_payload(batch_id, f"{g}/{i}"),
            field="",
            policy_version_start=version,
            num_bytes=100,
            scored=sample(g, i, version=version),
        )
        for g in groups
        for i in range(2)
    ]
    return BatchManifest(
        id=batch_id, index=index, samples=refs, policy_version=index, staleness=[index - version] * len(refs)
    )


class Pair:
    """Two lanes (lane 0 on the home Redis, lane 1 on the second) and the joiner's view of them."""

    def __init__(self, home_url: str, lane1_url: str, run_id: str) -> None:
        self.urls = [home_url, lane1_url]
        self.home_names = StreamNames(run_id)
        self.names = [lane_names(run_id, 0), lane_names(run_id, 1)]
        self.sync = [redis.Redis.from_url(u) for u in self.urls]

    def joiner(
        self,
        clients: list[aioredis.Redis],
        part_bytes: int = 2**20,
        cls: type[Joiner] = Joiner,
        key: bytes | None = None,
    ) -> Joiner:
        home = Bus(clients[0])
        lanes = [Lane(Bus(c), n) for c, n in zip(clients, self.names, strict=True)]
        config = ConsumerConfig(claim_interval_s=0.2)
        return cls(home, self.home_names, lanes, config, part_bytes=part_bytes, key=key)

    async def publish(
        self, clients: list[aioredis.Redis], lane: int, manifest: BatchManifest, part_bytes: int = 2**20
    ) -> None:
        """XADD a lane batch as a coordinator does (split into lane parts when its refs pass ``part_bytes``)."""
        bus = Bus(clients[lane])
        published = await store_parts(bus, self.names[lane], manifest, part_bytes)
        tx = bus.tx()
        for part in published.parts:
            tx.call("PERSIST", part)
        await tx.xadd(self.names[lane].batches, published).execute()

    def home_batches(self) -> list[BatchManifest]:
        return [decode(f[b"d"], BatchManifest) for _, f in self.sync[0].xrange(self.home_names.batches)]

    def letters(self, lane: int) -> list[DeadLetter]:
        return [decode(f[b"d"], DeadLetter) for _, f in self.sync[lane].xrange(self.names[lane].dead)]


@pytest.fixture
def pair(redis_url: str, second_redis: str, run_id: str) -> Pair:
    return Pair(redis_url, second_redis, run_id)


def run_until(
    pair: Pair, done: Callable[[], bool], scenario: Callable[[list[aioredis.Redis]], Any], kill: bool = False, **kw: Any
) -> None:
    """In one event loop: ``scenario(clients)`` (setup), then a joiner running until ``done()`` (within 20 s), then
    stopped (``kill``: cancelled where it is, as a killed process stops)."""

    async def main() -> None:
        clients = [connect(u) for u in pair.urls]
        stop = asyncio.Event()
        try:
            await scenario(clients)
            task = asyncio.create_task(pair.joiner(clients, **kw).run(stop))
            deadline = time.monotonic() + 20
            while not done():
                assert not task.done(), task.exception()
                assert time.monotonic() < deadline, "timed out waiting for the joiner"
                await asyncio.sleep(0.05)
            if kill:
                task.cancel()
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)
        finally:
            for c in clients:
                await c.aclose()

    asyncio.run(main())


def test_the_joiner_publishes_one_home_manifest_per_index_with_every_lanes_samples(pair: Pair) -> None:
    lane1_parts: list[str] = []

    async def scenario(clients: list[aioredis.Redis]) -> None:
        await pair.publish(clients, 0, lane_manifest(pair.names[0], 0, ["p0", "p2"]))
        # lane 1's batch 0 is split (as a big one is): the joiner reads its lane parts, then deletes them
        await pair.publish(clients, 1, lane_manifest(pair.names[1], 0, ["p1", "p3"], version=0), part_bytes=1200)
        lane1_parts.extend(k.decode() for k in pair.sync[1].keys("*manifest*"))
        await pair.publish(clients, 1, lane_manifest(pair.names[1], 1, ["p5", "p7"], version=1))
        await pair.publish(clients, 0, lane_manifest(pair.names[0], 1, ["p4", "p6"], version=0))

    # the joined manifests are split into home parts (as the coordinator splits a big one)
    run_until(pair, lambda: len(pair.home_batches()) >= 2, scenario, part_bytes=1500)
    time.sleep(0.5)
    published = pair.home_batches()
    assert [(b.id, b.index) for b in published] == [("batch-0", 0), ("batch-1", 1)]
    assert lane1_parts and not pair.sync[1].exists(*lane1_parts), "lane 1's own manifest parts were kept"

    async def whole() -> list[BatchManifest]:
        client = connect(pair.urls[0])
        try:
            return [await load_manifest(client, b, max_reply_bytes=2**20) for b in published]
        finally:
            await client.aclose()

    first, second = asyncio.run(whole())
    assert all(b.parts for b in published) and all(
        p.startswith(pair.home_names.batched_samples(b.id, "")) for b in published for p in b.parts
    )
    assert [s.trajectory_id for s in first.samples] == ["p0/0", "p0/1", "p2/0", "p2/1", "p1/0", "p1/1", "p3/0", "p3/1"]
    assert [lane_of_key(s.key) for s in first.samples] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert first.samples[4].key == pair.names[1].batched_payload("batch-0", "p1/0")
    assert [s.group_id for s in second.samples[::2]] == ["p4", "p6", "p5", "p7"]
    assert second.staleness == [1, 1, 1, 1, 0, 0, 0, 0] and second.policy_version == 1
    for k in (0, 1):  # every lane entry acknowledged
        assert pair.sync[k].xpending(pair.names[k].batches, "joiner")["pending"] == 0


class Crashing(Joiner):
    """A joiner that dies right after publishing, before it cleans up (the process killed there)."""

    async def clean_up(self, index: int) -> None:
        await asyncio.Event().wait()


def test_a_joiner_restarted_between_publish_and_acks_never_publishes_an_index_twice(pair: Pair) -> None:
    async def batch0(clients: list[aioredis.Redis]) -> None:
        await pair.publish(clients, 0, lane_manifest(pair.names[0], 0, ["p0"]))
        await pair.publish(clients, 1, lane_manifest(pair.names[1], 0, ["p1"]), part_bytes=600)

    run_until(pair, lambda: len(pair.home_batches()) >= 1, batch0, kill=True, cls=Crashing)  # then "killed"
    assert pair.sync[0].smembers(pair.home_names.state("joiner_cleanup")) == {b"0"}
    assert pair.sync[1].keys("*manifest*"), "lane 1's parts were deleted before the crash"

    async def batch1(clients: list[aioredis.Redis]) -> None:
        await pair.publish(clients, 0, lane_manifest(pair.names[0], 1, ["p2"]))
        await pair.publish(clients, 1, lane_manifest(pair.names[1], 1, ["p3"]))

    run_until(pair, lambda: len(pair.home_batches()) >= 2, batch1)
    time.sleep(0.5)
    assert [b.index for b in pair.home_batches()] == [0, 1]
    assert not pair.sync[1].keys("*manifest*"), "the restarted joiner did not finish cleaning up index 0"
    assert not pair.sync[0].smembers(pair.home_names.state("joiner_cleanup"))
    for k in (0, 1):
        assert pair.sync[k].xpending(pair.names[k].batches, "joiner")["pending"] == 0
        assert not pair.letters(k)


def test_weights_are_mirrored_into_every_lane_once_each_across_restarts(pair: Pair) -> None:
    home = pair.sync[0]
    sent = [ready(v)[b"d"] for v in range(3)]
    home.xadd(pair.home_names.weights, {b"d": sent[0]})
    home.xadd(pair.home_names.weights, {b"d": sent[1]})

    def mirrored(n: int) -> Callable[[], bool]:
        return lambda: all(pair.sync[k].xlen(pair.names[k].weights) >= n for k in (0, 1))

    async def nothing(clients: list[aioredis.Redis]) -> None:
        pass

    run_until(pair, mirrored(2), nothing)
    home.xadd(pair.home_names.weights, {b"d": sent[2]})
    run_until(pair, mirrored(3), nothing)  # a restarted joiner reads the home stream again from the marks
    run_until(pair, mirrored(3), nothing)
    time.sleep(0.3)
    for k in (0, 1):
        assert [f[b"d"] for _, f in pair.sync[k].xrange(pair.names[k].weights)] == sent


def test_a_learner_dead_letter_about_a_joined_batch_reaches_every_lane_as_its_own(pair: Pair) -> None:
    async def batch0(clients: list[aioredis.Redis]) -> None:
        for k, groups in ((0, ["p0", "p2"]), (1, ["p1"])):
            for ref in lane_manifest(pair.names[k], 0, groups).samples:
                await clients[k].set(ref.key, b"payload")
            await pair.publish(clients, k, lane_manifest(pair.names[k], 0, groups))

    run_until(pair, lambda: len(pair.home_batches()) >= 1, batch0, part_bytes=1500)
    (joined,) = pair.home_batches()
    assert joined.parts
    letter = DeadLetter(
        stream=pair.home_names.batches,
        entry_id="1-0",
        group="learner",
        consumer="l",
        error=f"batch-0 (6 samples) {BATCH_SKIPPED}: a payload is missing",
        deliveries=1,
        payload=encode(joined),
        ts=1.0,
    )
    pair.sync[0].xadd(pair.home_names.dead, {b"d": encode(letter)})

    async def nothing(clients: list[aioredis.Redis]) -> None:
        pass

    run_until(pair, lambda: all(pair.letters(k) for k in (0, 1)), nothing)
    run_until(pair, lambda: True, nothing)  # restarted: relays nothing twice
    time.sleep(0.3)
    assert not pair.sync[0].exists(*joined.parts), "the dead joined batch's home parts were kept"
    for k, groups, count in ((0, ("p0", "p2"), 4), (1, ("p1",), 2)):
        (relayed,) = pair.letters(k)
        lost = what_was_lost(relayed, batches_stream=pair.names[k].batches, key=None, run_id=pair.home_names.run_id)
        assert isinstance(lost, LostBatch), lost
        assert (lost.batch_id, lost.num_samples, lost.num_groups) == ("batch-0", count, len(groups))
        assert "a payload is missing" in relayed.error
        # the lane's coordinator accounts for it as today: counted dropped, its payloads deleted
        keys = list(lost.buffers)

        async def account(k: int = k, lost: LostBatch = lost) -> bool:
            client = connect(pair.urls[k])
            try:
                state = RunState(Bus(client), pair.names[k])
                groups_ = GroupBuffer(state, group_size=2, dynamic_filtering=False)
                builder = BatchBuilder(state, groups_, prompts_per_step=1, max_staleness=0, drop_stale=True)
                return await builder.record_dead(lost.batch_id, lost.num_samples, lost.num_groups, "x", lost.buffers)
            finally:
                await client.aclose()

        assert asyncio.run(account())
        assert keys and not pair.sync[k].exists(*keys)
        assert pair.sync[k].get(pair.names[k].state("samples_dead")) == str(count).encode()


def test_a_refused_joined_batch_is_sent_again_on_the_home(pair: Pair) -> None:
    async def batch0(clients: list[aioredis.Redis]) -> None:
        await pair.publish(clients, 0, lane_manifest(pair.names[0], 0, ["p0"]))
        await pair.publish(clients, 1, lane_manifest(pair.names[1], 0, ["p1"]))

    run_until(pair, lambda: len(pair.home_batches()) >= 1, batch0)
    (joined,) = pair.home_batches()
    letter = DeadLetter(
        stream=pair.home_names.batches,
        entry_id="1-0",
        group="learner",
        consumer="l",
        error="batch-0 arrived out of order",
        deliveries=1,
        payload=encode(joined),
        ts=1.0,
    )
    pair.sync[0].xadd(pair.home_names.dead, {b"d": encode(letter)})

    async def nothing(clients: list[aioredis.Redis]) -> None:
        pass

    run_until(pair, lambda: len(pair.home_batches()) >= 2, nothing)
    assert [b.id for b in pair.home_batches()] == ["batch-0", "batch-0"]
    assert not pair.letters(0) and not pair.letters(1)


def test_bad_lane_entries_are_dead_lettered_naming_them_never_joined(pair: Pair, run_id: str) -> None:
    other = lane_names(f"{run_id}x", 1)

    async def scenario(clients: list[aioredis.Redis]) -> None:
        await pair.publish(clients, 0, lane_manifest(pair.names[0], 0, ["p0"]))
        await pair.publish(clients, 1, lane_manifest(pair.names[1], 0, ["p1"]))
        await pair.publish(clients, 1, lane_manifest(pair.names[1], 0, ["p3"]))  # index 0 again
        await pair.publish(clients, 1, lane_manifest(other, 1, ["p5"]))  # another run's

    run_until(pair, lambda: len(pair.letters(1)) >= 2, scenario)
    time.sleep(0.3)
    assert [b.index for b in pair.home_batches()] == [0]
    first, second = pair.letters(1)
    assert "lane 1's batch-0 (index 0): index 0 was taken already" in first.error
    assert "keys not of its batch in lane 1" in second.error and "another run" in second.error
    for letter in (first, second):  # counted by lane 1's coordinator, never taken for a batch to drop or resend
        assert letter.stream == pair.home_names.batches
        assert (
            what_was_lost(letter, batches_stream=pair.names[1].batches, key=None, run_id=pair.home_names.run_id) is None
        )
    assert pair.sync[1].xpending(pair.names[1].batches, "joiner")["pending"] == 0


def answer(client: redis.Redis, names: StreamNames, item: PromptWorkItem) -> None:
    """Every sample of ``item``'s group generated and scored in its lane, as the rollout and reward tiers write it."""
    for i in range(item.sampling.n):
        traj = Trajectory(
            id=f"{item.id}/{i}",
            group_id=item.id,
            group_index=i,
            group_size=item.sampling.n,
            prompt_ids=item.prompt_ids,
            response_ids=Tensor.from_list([5], "int32"),
            logprobs=Tensor.from_list([-1.0], "float32"),
            loss_mask=Tensor.from_list([1], "uint8"),
            policy_version_start=item.policy_version,
            policy_version_end=item.policy_version,
        )
        key = names.payload(traj.id, "t")
        client.set(key, encode(traj))
        record = ScoredRecord(trajectory=record_of(traj, key, len(encode(traj))), reward=1.0, score=1.0)
        client.xadd(names.scored, {b"d": encode(record)})


def test_two_lane_coordinators_feed_one_joined_batch_and_follow_the_home_weights(
    tiny_task: Path, tmp_path: Path, redis_url: str, second_redis: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    urls = [redis_url, second_redis]
    clients = [redis.Redis.from_url(u) for u in urls]
    names = [lane_names(run_id, 0), lane_names(run_id, 1)]
    home = StreamNames(run_id)
    extra = ("--coordinator.group_size=2", "--coordinator.dataset.shuffle=false")
    # the learner signs its weights for the run: each lane checks its mirrored copy against the run, not the lane
    env = {KEY_ENV: WEIGHTS_KEY}
    procs = [
        start(write_recipe(tiny_task, tmp_path / f"run{k}", redis_url), run_id, k, urls, *extra, env=env)
        for k in (0, 1)
    ]
    try:
        clients[0].xadd(
            home.weights, ready(0, signed_for=run_id)
        )  # the learner is ready: mirrored into both lanes, both issue
        for k in (0, 1):
            wait_for(lambda k=k: clients[k].xlen(names[k].prompts) >= 4, 120, f"lane {k}'s prompts", procs[k])
        issued = [
            [decode(f[b"d"], PromptWorkItem) for _, f in c.xrange(n.prompts)]
            for c, n in zip(clients, names, strict=True)
        ]
        assert [p.id for p in issued[0]] == ["p0", "p2", "p4", "p6"]
        assert [p.id for p in issued[1]] == ["p1", "p3", "p5", "p7"]
        for k in (0, 1):
            for item in issued[k][:2]:  # the lane's batch 0 (version 0)
                answer(clients[k], names[k], item)
        wait_for(lambda: clients[0].xlen(home.batches) >= 1, 60, "the joined batch 0", procs[0])
        (entry,) = [decode(f[b"d"], BatchManifest) for _, f in clients[0].xrange(home.batches)]
        assert (entry.id, entry.num_samples) == ("batch-0", 8)
        groups = [s.group_id for s in entry.samples[::2]]  # each lane's in lane order (completion order within it)
        assert sorted(groups[:2]) == ["p0", "p2"] and sorted(groups[2:]) == ["p1", "p3"]
        assert [lane_of_key(s.key) for s in entry.samples] == [0, 0, 0, 0, 1, 1, 1, 1]
        # the learner trains it and publishes version 1: both lanes follow
        clients[0].xadd(home.weights, ready(1, signed_for=run_id))
        for k in (0, 1):
            wait_for(
                lambda k=k: int(clients[k].get(names[k].state("policy_version")) or 0) == 1,
                30,
                f"lane {k} at version 1",
                procs[k],
            )
        assert clients[0].exists(home.lease("singleton", "joiner"))
        assert not clients[1].keys(f"*{{{run_id}}}*"), "lane 1's coordinator wrote home keys"
    finally:
        outs = [stop(p) for p in procs]
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out[-3000:]
    assert "joiner: batch-0 published (8 samples from 2 lanes)" in outs[0]


def test_a_join_whose_reply_is_lost_is_published_once(pair: Pair) -> None:
    """Redis runs the join's transaction, the reply is lost, the client's outage retry sends it again: one entry."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "faults"))
    from redis_proxy import FaultProxy

    async def main() -> None:
        proxy = FaultProxy(urlparse(pair.urls[0]).port or 6379)
        clients = [connect(u) for u in pair.urls]
        home = connect(proxy.listen("coordinator"))
        stop = asyncio.Event()
        try:
            await pair.publish(clients, 0, lane_manifest(pair.names[0], 0, ["p0"]))
            await pair.publish(clients, 1, lane_manifest(pair.names[1], 0, ["p1"]))
            await home.script_load(TX_LUA)
            proxy.drop_reply_to(pair.home_names.batches.encode())  # only the join's transaction names it
            lanes = [Lane(Bus(c), n) for c, n in zip(clients, pair.names, strict=True)]
            joiner = Joiner(Bus(home), pair.home_names, lanes, ConsumerConfig())
            task = asyncio.create_task(joiner.run(stop))
            deadline = time.monotonic() + 20
            while not pair.sync[0].xlen(pair.home_names.batches) or proxy.armed:
                assert not task.done() and time.monotonic() < deadline, "the join was not published"
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.wait_for(task, 10)
        finally:
            await home.aclose()
            for c in clients:
                await c.aclose()
            await asyncio.to_thread(proxy.close)
        assert len(proxy.lost) == 1

    asyncio.run(main())
    assert [b.index for b in pair.home_batches()] == [0]
    assert pair.sync[0].get(pair.home_names.state("batch_index")) == b"1"
