"""The batch builder against a real Redis: batches leave ``ready`` in the transaction that publishes
them, too-stale groups owe their replacement the batch's version, dead batches are counted once."""

from __future__ import annotations

import asyncio
import time

from coordinator_fakes import sample, store

from streamrl.common.batch_payloads import fetch_batch
from streamrl.common.codec import decode
from streamrl.common.messages import BatchManifest, ScoredRecord, TrainingBatch
from streamrl.coordinator import state as st
from streamrl.coordinator.batches import BatchBuilder
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.state import RunState


async def ready_groups(groups: GroupBuffer, *wanted: tuple[str, int]) -> None:
    """Groups issued and complete (each of 2 samples generated at the given version)."""
    tx = groups.state.tx()
    for group, version in wanted:
        groups.queue_issue(tx, group, version, time.time())
    await tx.execute()
    for group, version in wanted:
        await store(groups.state, group, sample(group, 0, 1.0, version=version), sample(group, 1, 0.0, version=version))
    await groups.complete(None)


def builder(state: RunState, max_staleness: int = 0, wait_s: float = 30.0) -> BatchBuilder:
    groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
    return BatchBuilder(state, groups, prompts_per_step=2, max_staleness=max_staleness, drop_stale=True, wait_s=wait_s)


async def in_flight(groups: GroupBuffer, group: str, required_version: int) -> None:
    """A group issued (its prompt requiring ``required_version``) and not complete yet."""
    tx = groups.state.tx()
    groups.queue_issue(tx, group, required_version, time.time())
    await tx.execute()


async def batches(state: RunState) -> list[TrainingBatch]:
    """The batches published, as the learner reads them (manifests, their payloads fetched)."""
    manifests = [decode(f[b"d"], BatchManifest) for _, f in await state.redis.xrange(state.names.batches)]
    return [await fetch_batch(state.redis, m, max_reply_bytes=2**20) for m in manifests]


def same_samples(batch: TrainingBatch, records: list[ScoredRecord]) -> bool:
    """The learner's batch holds exactly the scored records the coordinator batched, with their payloads."""
    return [(s.trajectory.id, s.reward, s.score, s.trajectory.policy_version_start) for s in batch.samples] == [
        (r.trajectory.id, r.reward, r.score, r.trajectory.policy_version_start) for r in records
    ] and all(
        len(s.trajectory.response_ids) == r.trajectory.num_response_tokens
        for s, r in zip(batch.samples, records, strict=True)
    )


def test_a_batch_takes_its_groups_in_one_transaction(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        build = builder(state)
        await ready_groups(build.groups, ("a", 0), ("b", 0), ("c", 0))
        (built,) = await build.build(version=0)
        assert (built.batch.index, len(built.batch.samples), built.num_too_stale) == (0, 4, 0)
        (fetched,) = await batches(state)
        assert fetched.index == 0 and same_samples(fetched, built.batch.samples)
        taken = {s.trajectory.group_id for s in built.batch.samples}
        (left,) = await build.groups.ready()
        assert taken | {left} == {"a", "b", "c"} and await state.get_int(st.BATCH_INDEX) == 1
        assert not any([await state.redis.exists(state.names.group_buffer(g)) for g in taken])
        # each payload kept for the learner under its batched name (a late copy of a sample names another)
        ids = [s.trajectory.id for s in built.batch.samples]
        assert all([await state.redis.exists(state.names.batched_payload("batch-0", t)) for t in ids])
        assert not any([await state.redis.exists(state.names.payload(t, "t")) for t in ids])

    in_redis(scenario)


def test_too_stale_groups_are_dropped_and_owe_the_batchs_version(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        build = builder(state)
        await state.redis.set(state.key(st.BATCH_INDEX), 3)
        await ready_groups(build.groups, ("old", 1), ("a", 3))
        assert await build.build(version=3) == []  # "old" dropped; one group is not a batch
        assert await build.groups.owed() == [3] and await state.get_int(st.ACCEPTED) == 1
        await ready_groups(build.groups, ("b", 3))
        (built,) = await build.build(version=3)
        assert built.num_too_stale == 2 and built.batch.staleness == [0, 0, 0, 0]
        assert await state.get_int(st.SAMPLES_TOO_STALE) == 2

    in_redis(scenario)


def test_a_batch_waits_for_a_slow_group_rather_than_throw_it_away(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        # one step of staleness, policy at 1: batch 1 is the last a group generated at 0 may go in. "slow" (version
        # 0) is still being scored while "next" (version 1, a group of batch 2) completed before it
        build = builder(state, max_staleness=1)
        await state.redis.set(state.key(st.BATCH_INDEX), 1)
        await ready_groups(build.groups, ("a", 0), ("next", 1))
        await in_flight(build.groups, "slow", 0)
        assert await build.build(version=1) == []  # it waits: with "next" in it, "slow" would be thrown away
        await store(state, "slow", sample("slow", 0, version=0), sample("slow", 1, version=0))
        await build.groups.complete(None)
        (built,) = await build.build(version=1)
        assert {s.trajectory.group_id for s in built.batch.samples} == {"a", "slow"} and built.waited_s > 0
        assert await build.groups.ready() == ["next"] and await state.get_int(st.SAMPLES_TOO_STALE) == 0

    in_redis(scenario)


def test_a_batch_waits_only_batch_wait_s(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        build = builder(state, max_staleness=1, wait_s=0.2)
        await state.redis.set(state.key(st.BATCH_INDEX), 1)
        await ready_groups(build.groups, ("a", 0), ("next", 1))
        await in_flight(build.groups, "lost", 0)
        assert await build.build(version=1) == []
        await asyncio.sleep(0.5)  # past the wait: built without it (it will be too stale, counted)
        (built,) = await build.build(version=1)
        assert {s.trajectory.group_id for s in built.batch.samples} == {"a", "next"} and built.waited_s >= 0.2
        # a replacement owed for a lost group counts as coming too (its version as owed, until it is issued)
        await state.redis.rpush(state.key(st.OWED_VERSIONS), 1)
        await ready_groups(build.groups, ("b", 1), ("c", 2))
        assert await build.build(version=2) == []

    in_redis(scenario)


def test_a_dead_lettered_batch_is_counted_once(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        build = builder(state)
        assert await build.record_dead("batch-4", 8, 2, "RuntimeError: loss is not finite")
        assert not await build.record_dead("batch-4", 8, 2, "RuntimeError: loss is not finite")
        assert await build.record_dead("batch-5", 6, None, "its payload was cut")
        counters = await state.counters()
        assert (counters[st.BATCHES_DEAD], counters[st.SAMPLES_DEAD], counters[st.BATCH_GROUPS_DEAD]) == (2, 14, 2)

    in_redis(scenario)
