"""Every coordinator write survives a lost reply: Redis runs it, the connection drops before the
reply, the client's outage retry sends it again - and the run state shows it ran once.

A real redis-server behind the fault proxy (tests/faults/redis_proxy.py, ``drop_reply_to``; 127.0.0.1); each test drives one of the
coordinator's write points (``state.py`` lists them) through a client connected to the proxy.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from streamrl.common.bus import Bus, connect
from streamrl.common.codec import decode, encode
from streamrl.common.messages import BatchManifest, PromptWorkItem, ScoredRecord, Tensor, Trajectory
from streamrl.common.payloads import record_of
from streamrl.common.streams import StreamNames
from streamrl.common.tx import TX_LUA
from streamrl.coordinator import state as st
from streamrl.coordinator.batches import BatchBuilder
from streamrl.coordinator.config import CoordinatorConfig, DatasetConfig
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.issuing import PromptIssuer
from streamrl.coordinator.prompts import Prompt
from streamrl.coordinator.state import RunState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
from redis_proxy import FaultProxy


async def lose_reply(proxy: FaultProxy, state: RunState, marker: str, *scripts: str) -> None:
    """Arm ``proxy`` for the next call holding ``marker`` (a key, or a script's SHA1), once the scripts
    are loaded (else the first call is a NOSCRIPT that never ran)."""
    for script in (TX_LUA, *scripts):
        await state.redis.script_load(script)
    proxy.drop_reply_to(marker.encode())


def sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


class Prompts:
    """A prompt source of 1000 arithmetic rows (the dataset itself is not what is tested here)."""

    def __len__(self) -> int:
        return 1000

    def get(self, cursor: int) -> Prompt:
        return self.encode(cursor % len(self))

    def encode(self, index: int) -> Prompt:
        return Prompt(index=index, text=f"{index}+1=", ids=[1, 2, 3], label=str(index + 1), metadata={})


async def put(redis: Any, names: StreamNames, group: str, index: int, score: float, version: int = 0) -> None:
    """Sample ``index`` of ``group`` stored as the pipeline stores it: its payload (rollout), its scored record in
    the group's buffer (the scored consumer)."""
    traj = trajectory(group, index, version)
    record = record_of(traj, names.payload(traj.id, "t"), len(encode(traj)))
    await redis.set(record.payload_key, encode(traj))
    await redis.hset(
        names.group_buffer(group), traj.id, encode(ScoredRecord(trajectory=record, reward=score, score=score))
    )


def trajectory(group: str, index: int, version: int = 0) -> Trajectory:
    return Trajectory(
        id=f"{group}/{index}",
        group_id=group,
        group_index=index,
        group_size=2,
        prompt_ids=Tensor.from_list([1], "int32"),
        response_ids=Tensor.from_list([5, 6], "int32"),
        logprobs=Tensor.from_list([-1.0, -1.0], "float32"),
        loss_mask=Tensor.from_list([1, 1], "uint8"),
        policy_version_start=version,
        policy_version_end=version,
    )


def through_proxy(redis_url: str, run_id: str, scenario: Callable[[RunState, FaultProxy], Awaitable[Any]]) -> Any:
    """Run ``scenario(state, proxy)`` with the run state's client connected through a lost-reply proxy."""

    async def main() -> Any:
        proxy = FaultProxy(urlparse(redis_url).port or 6379)
        client = connect(proxy.listen("coordinator"), outage_s=10)
        try:
            return await scenario(RunState(Bus(client), StreamNames(run_id)), proxy)
        finally:
            await client.aclose()
            await asyncio.to_thread(proxy.close)

    return asyncio.run(main())


async def ready_groups(groups: GroupBuffer, *wanted: tuple[str, int]) -> None:
    """Groups issued and complete, each of 2 samples generated at the given version."""
    tx = groups.state.tx()
    for group, version in wanted:
        groups.queue_issue(tx, group, version, time.time())
    await tx.execute()
    for group, version in wanted:
        for i in range(2):
            await put(groups.redis, groups.state.names, group, i, float(i), version)
    await groups.complete(None)


def builder(state: RunState, max_staleness: int = 1) -> BatchBuilder:
    groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
    return BatchBuilder(state, groups, prompts_per_step=2, max_staleness=max_staleness, drop_stale=True)


async def batch_indices(state: RunState) -> list[int]:
    return [decode(f[b"d"], BatchManifest).index for _, f in await state.redis.xrange(state.names.batches)]


def test_a_lost_reply_to_a_batch_publication_publishes_it_once(redis_url: str, run_id: str) -> None:
    async def scenario(state: RunState, proxy: FaultProxy) -> None:
        build = builder(state)
        await ready_groups(build.groups, ("a", 0), ("b", 0), ("c", 0), ("d", 0))
        await lose_reply(proxy, state, state.names.batches)
        built = await build.build(version=0)
        assert len(proxy.lost) == 1
        assert await batch_indices(state) == [0, 1], "a re-sent publication duplicated a batch"
        assert [b.batch.index for b in built] == [0, 1]
        assert await state.get_int(st.BATCH_INDEX) == 2
        assert await build.groups.ready() == []

    through_proxy(redis_url, run_id, scenario)


def test_two_builders_racing_never_publish_an_index_twice(redis_url: str, run_id: str) -> None:
    """A deposed coordinator and its successor (or a re-sent publication) both building batch 0 from
    the same view: one publishes it, the other finds the index taken and builds batch 1."""

    async def scenario(state: RunState, proxy: FaultProxy) -> None:
        first, second = builder(state), builder(state)
        await ready_groups(first.groups, ("a", 0), ("b", 0), ("c", 0), ("d", 0))
        for build in (first, second):
            read = build.groups.stored

            async def slow_read(groups: list[str], read: Any = read) -> Any:
                out = await read(groups)
                await asyncio.sleep(0.2)  # both have read batch_index = 0 and the ready groups by now
                return out

            build.groups.stored = slow_read  # type: ignore[method-assign]
        await asyncio.gather(first.build(version=0), second.build(version=0))
        assert await batch_indices(state) == [0, 1], "two builders published the same index"
        assert await state.get_int(st.BATCH_INDEX) == 2 and await first.groups.ready() == []

    through_proxy(redis_url, run_id, scenario)


def test_a_lost_reply_to_dropping_too_stale_groups_drops_them_once(redis_url: str, run_id: str) -> None:
    async def scenario(state: RunState, proxy: FaultProxy) -> None:
        build = builder(state, max_staleness=0)
        await state.redis.set(state.key(st.BATCH_INDEX), 3)
        await ready_groups(build.groups, ("old", 1), ("a", 3))
        await lose_reply(proxy, state, state.key(st.SAMPLES_TOO_STALE))
        assert await build.build(version=3) == []
        assert len(proxy.lost) == 1
        assert await build.groups.owed() == [3], "the replacement was owed twice"
        assert await state.get_int(st.ACCEPTED) == 1
        assert await state.get_int(st.SAMPLES_TOO_STALE) == 2

    through_proxy(redis_url, run_id, scenario)


def issuer(state: RunState, **fields: Any) -> PromptIssuer:
    config = CoordinatorConfig(
        dataset=DatasetConfig(path="unused.jsonl", tokenizer="unused"),
        group_size=2,
        prompts_per_step=4,
        prefetch_steps=0,
        wait_for_learner=False,
        **fields,
    )
    groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
    return PromptIssuer(config, state, groups, Prompts())  # type: ignore[arg-type]


async def issued(state: RunState) -> list[str]:
    return [decode(f[b"d"], PromptWorkItem).id for _, f in await state.redis.xrange(state.names.prompts)]


def test_a_lost_reply_to_issuing_prompts_issues_them_once(redis_url: str, run_id: str) -> None:
    async def scenario(state: RunState, proxy: FaultProxy) -> None:
        issue = issuer(state)
        await lose_reply(proxy, state, state.names.prompts)
        assert await issue.issue(version=0) == 4
        assert len(proxy.lost) == 1
        assert await issued(state) == ["p0", "p1", "p2", "p3"], "a re-sent issue duplicated prompts"
        assert await state.get_int(st.CURSOR) == 4, "a re-sent issue moved the cursor twice (a gap)"
        assert await issue.groups.in_flight() == 4
        assert await issue.issue(version=0) == 0

    through_proxy(redis_url, run_id, scenario)


def test_a_lost_reply_to_a_groups_completion_readies_it_once(redis_url: str, run_id: str) -> None:
    async def scenario(state: RunState, proxy: FaultProxy) -> None:
        groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
        tx = state.tx()
        groups.queue_issue(tx, "a", 0, time.time())
        await tx.execute()
        for i in range(2):
            await put(state.redis, state.names, "a", i, float(i))
        await lose_reply(proxy, state, sha(groups._leave.source), groups._leave.source)
        await groups.complete(None)
        assert len(proxy.lost) == 1
        assert await groups.ready() == ["a"] and await state.get_int(st.ACCEPTED) == 1

    through_proxy(redis_url, run_id, scenario)


def test_a_lost_reply_to_a_groups_failure_fails_it_once(redis_url: str, run_id: str) -> None:
    async def scenario(state: RunState, proxy: FaultProxy) -> None:
        groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
        tx = state.tx()
        groups.queue_issue(tx, "a", 2, time.time())
        await tx.execute()
        await lose_reply(proxy, state, sha(groups._leave.source), groups._leave.source)
        assert await groups.fail("a", st.GROUPS_DEAD), "the re-sent call said the group was not in flight"
        assert len(proxy.lost) == 1
        assert await groups.owed() == [2] and await state.get_int(st.GROUPS_DEAD) == 1

    through_proxy(redis_url, run_id, scenario)


def test_a_lost_reply_to_counting_a_dead_batch_counts_it_once(redis_url: str, run_id: str) -> None:
    async def scenario(state: RunState, proxy: FaultProxy) -> None:
        build = builder(state)
        await lose_reply(proxy, state, sha(build._dead_batch.source), build._dead_batch.source)
        assert await build.record_dead("batch-4", 8, 2, "RuntimeError: loss is not finite"), "counted as seen before"
        assert len(proxy.lost) == 1
        counters = await state.counters()
        assert (counters[st.BATCHES_DEAD], counters[st.SAMPLES_DEAD]) == (1, 8)

    through_proxy(redis_url, run_id, scenario)


def test_a_deposed_coordinator_writes_nothing(redis_url: str, run_id: str) -> None:
    """Once another process holds the coordinator's lease, every write of this one - transactions and
    the coordinator's own scripts - is refused whole with LeaseLostError."""
    from streamrl.common.lease import LeaseLostError
    from streamrl.common.tx import Fence

    async def scenario(state: RunState, proxy: FaultProxy) -> None:
        build = builder(state)
        await ready_groups(build.groups, ("a", 0), ("b", 0))
        lease = state.names.lease("singleton", "coordinator")
        state.bus.fence = Fence(lease, "this-coordinator")
        await state.redis.set(lease, "its-successor")
        before = await state.redis.dump(state.key(st.READY))
        with pytest.raises(LeaseLostError, match="held by"):
            await build.build(version=0)
        with pytest.raises(LeaseLostError):
            await build.groups.fail("a", st.GROUPS_DEAD)
        with pytest.raises(LeaseLostError):
            await issuer(state).issue(version=0)
        assert await state.redis.xlen(state.names.batches) == 0 and await state.redis.xlen(state.names.prompts) == 0
        assert await state.redis.dump(state.key(st.READY)) == before and await state.get_int(st.GROUPS_DEAD) == 0
        await state.redis.set(lease, "this-coordinator")  # its own lease again: it writes
        assert [b.batch.index for b in await build.build(version=0)] == [0]

    through_proxy(redis_url, run_id, scenario)


def test_an_evaluation_round_of_many_prompts_starts_in_one_script(redis_url: str, run_id: str, tmp_path: Path) -> None:
    """A round's prompts travel as arguments of one fenced script: 10,000 of them (more than Lua can unpack)."""
    from streamrl.coordinator.config import EvalConfig
    from streamrl.coordinator.evaluation import EvalRounds
    from streamrl.coordinator.metrics import MetricsWriter

    class Many(Prompts):
        def __len__(self) -> int:
            return 10_000

        def warm(self, indices: range) -> None:
            pass

    async def scenario(state: RunState, proxy: FaultProxy) -> None:
        held_out = EvalConfig(dataset=DatasetConfig(path="eval.jsonl", tokenizer="t"), num_prompts=10_000)
        config = CoordinatorConfig(dataset=DatasetConfig(path="unused.jsonl", tokenizer="unused"), eval=held_out)
        rounds = EvalRounds(config, state, Many(), MetricsWriter(tmp_path))  # type: ignore[arg-type]
        await rounds.maybe_start(0)
        assert await state.redis.xlen(state.names.prompts) == 10_000

    through_proxy(redis_url, run_id, scenario)


def test_a_lost_reply_to_dropping_late_samples_counts_them_once(redis_url: str, run_id: str) -> None:
    async def scenario(state: RunState, proxy: FaultProxy) -> None:
        groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
        for i in range(2):  # samples of a group already failed: neither in flight nor ready
            await put(state.redis, state.names, "gone", i, 1.0)
        await lose_reply(proxy, state, sha(groups._drop_late.source), groups._drop_late.source)
        await groups.drop_late(["gone"])
        assert len(proxy.lost) == 1
        assert await state.get_int(st.LATE_SAMPLES_DROPPED) == 2
        assert not await state.redis.exists(groups.buffer("gone"))

    through_proxy(redis_url, run_id, scenario)


def test_the_running_service_loses_no_batch_and_duplicates_none_under_lost_replies(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    """The whole coordinator, its Redis client behind the proxy, which loses the reply of one of its
    writes (every write is a script call) every 0.15 s, at least two per step, while it issues, collects and batches four steps
    (the test plays rollout, reward and learner on the real streams)."""
    import redis as syncredis
    from test_coordinator import Harness

    from streamrl.common.config import load_config
    from streamrl.common.lifecycle import ServiceContext
    from streamrl.common.messages import WeightsPublished
    from streamrl.coordinator.service import CoordinatorService

    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    steps = 4

    async def scenario() -> tuple[int, list[BatchManifest], list[PromptWorkItem], int]:
        proxy = FaultProxy(urlparse(redis_url).port or 6379)
        args = [f"--run_id={run_id}", "--coordinator.eval.dataset=null", f"--total_steps={steps}"]
        config = load_config(CoordinatorConfig, str(recipe), args, section="coordinator")
        names = StreamNames(run_id)
        bus = Bus(connect(proxy.listen("coordinator"), outage_s=20), maxlen=config.redis.maxlen)
        ctx = ServiceContext(
            service="coordinator", instance="t", config=config, bus=bus, names=names, stop=asyncio.Event()
        )
        h = Harness(syncredis.Redis.from_url(redis_url), names, Path(config.run_dir))
        service = await asyncio.to_thread(CoordinatorService, config, ctx)
        h.service_task = asyncio.create_task(service.run())

        async def lose_replies() -> None:
            armed_at = -10
            while True:  # a reply lost, then (the retry's included) a few through before the next one is lost
                if not proxy.armed and proxy.forwarded >= armed_at + 5:
                    proxy.drop_reply_to(b"EVALSHA")
                    armed_at = proxy.forwarded
                await asyncio.sleep(0.15)

        losing = asyncio.create_task(lose_replies())
        answered: set[str] = set()
        version = 0
        batch_seen = float("inf")
        h.weights(0)
        deadline = time.monotonic() + 120
        while version < steps:
            assert time.monotonic() < deadline, f"stuck at version {version}"
            assert not h.service_task.done(), h.service_task.exception()
            for item in h.prompts():
                if item.id not in answered and item.policy_version <= version:
                    answered.add(item.id)
                    for i in range(item.sampling.n):  # the reward tier's output, once per trajectory
                        h.score_one(item, i, float(i % 2))
            if h.client.xlen(names.batches) > version:  # the learner trains it and publishes the next version
                batch_seen = min(batch_seen, time.monotonic())
                if len(proxy.lost) < 2 * (version + 1) and time.monotonic() < batch_seen + 3.0:
                    await asyncio.sleep(0.05)  # (a fast machine: let a few more replies be lost each step)
                    continue
                version += 1
                batch_seen = float("inf")
                h.client.xadd(
                    names.weights,
                    {
                        b"d": encode(
                            WeightsPublished(
                                version=version,
                                step=version,
                                batch_id=f"batch-{version - 1}",
                                checksum="0",
                                num_bytes=0,
                                num_buckets=0,
                                endpoint="tcp://127.0.0.1:1",
                            )
                        )
                    },
                )
            await asyncio.sleep(0.05)
        losing.cancel()
        await asyncio.wait_for(h.service_task, 60)
        cursor = int(h.client.get(names.state("cursor")) or 0)
        batches = [decode(f[b"d"], BatchManifest) for _, f in h.client.xrange(names.batches)]
        items = h.prompts()
        await bus.redis.aclose()
        await asyncio.to_thread(proxy.close)
        return len(proxy.lost), batches, items, cursor

    dropped, batches, items, cursor = asyncio.run(scenario())
    assert dropped >= 5, f"only {dropped} replies were lost"
    assert [b.index for b in batches] == list(range(steps)), "a batch index was published twice or skipped"
    trained = [s.trajectory_id for b in batches for s in b.samples]
    assert len(trained) == len(set(trained)) == steps * 4 * 4, "a sample went into two batches"
    ids = [p.id for p in items]
    assert len(ids) == len(set(ids)), "a prompt was issued twice"
    assert sorted(int(i[1:]) for i in ids) == list(range(cursor)), "the cursor skipped or repeated a row"
