"""The group buffer against a real Redis: each group leaves the in-flight set once, lost groups owe
their version, overdue groups time out, late samples never stay behind."""

from __future__ import annotations

import logging
import time

import pytest
from coordinator_fakes import sample, store

from streamrl.coordinator import state as st
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.state import RunState


async def issue(groups: GroupBuffer, *wanted: tuple[str, int], issued_at: float | None = None) -> None:
    tx = groups.state.tx()
    for group, version in wanted:
        groups.queue_issue(tx, group, version, time.time() if issued_at is None else issued_at)
    await tx.execute()


async def members(state: RunState, name: str) -> set[str]:
    return {m.decode() for m in await state.redis.smembers(state.key(name))}


def test_a_complete_group_moves_to_ready_once(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
        await issue(groups, ("a", 0), ("b", 0))
        await store(state, "a", sample("a", 0), sample("a", 1))
        await store(state, "b", sample("b", 0))
        await groups.complete(None)
        await groups.complete(["a"])  # again: nothing moves twice
        assert await groups.ready() == ["a"] and await state.get_int(st.ACCEPTED) == 1
        assert await members(state, st.INFLIGHT) == {"b"}
        assert set(await state.redis.hkeys(state.key(st.INFLIGHT_INFO))) == {b"b"}
        assert not await groups.fail("a", st.GROUPS_DEAD), "a ready group is not failed"
        assert len((await groups.samples(["a"]))["a"]) == 2

    in_redis(scenario)


def test_a_lost_group_owes_the_version_it_required(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        groups = GroupBuffer(state, group_size=2, dynamic_filtering=True)
        await issue(groups, ("same", 0), ("dead", 1), ("kept", 1))
        await store(state, "same", sample("same", 0, 1.0), sample("same", 1, 1.0))  # no spread: filtered
        await store(state, "dead", sample("dead", 0))
        await store(state, "kept", sample("kept", 0, 1.0), sample("kept", 1, 0.0))
        await groups.complete(None)
        assert await groups.fail("dead", st.GROUPS_DEAD)
        assert not await groups.fail("dead", st.GROUPS_TIMED_OUT), "a group fails once"
        assert sorted(await groups.owed()) == [0, 1]
        assert await groups.ready() == ["kept"]
        counters = await state.counters()
        assert (counters[st.GROUPS_FILTERED], counters[st.GROUPS_DEAD], counters[st.GROUPS_TIMED_OUT]) == (1, 1, 0)
        for gone in ("same", "dead"):
            assert not await state.redis.exists(state.names.group_buffer(gone))
        tx = state.tx()
        groups.queue_repay(tx, [1])
        await tx.execute()
        assert await groups.owed() == [0]

    in_redis(scenario)


def test_overdue_groups_time_out_once_with_a_warning(in_redis, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
        now = time.time()
        await groups.version_published(0, now - 100)
        await issue(groups, ("old", 0), ("prefetched", 1), issued_at=now - 100)
        await issue(groups, ("young", 0), issued_at=now - 5)
        assert await groups.time_out(version=0, now=now, timeout_s=10.0) == ["old"]
        assert await groups.time_out(version=0, now=now, timeout_s=10.0) == []
        assert await members(state, st.INFLIGHT) == {"prefetched", "young"}
        assert await groups.owed() == [0] and await state.get_int(st.GROUPS_TIMED_OUT) == 1

    with caplog.at_level(logging.WARNING):
        in_redis(scenario)
    lines = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("group old timed out"), lines


def test_late_samples_of_a_failed_group_are_dropped_and_counted(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
        await issue(groups, ("failed", 0), ("running", 0), ("done", 0))
        await groups.fail("failed", st.GROUPS_DEAD)
        await store(state, "failed", sample("failed", 1))  # a member scored after its group failed
        await store(state, "running", sample("running", 0))
        await store(state, "done", sample("done", 0), sample("done", 1))
        await groups.complete(None)
        assert await groups.drop_late(["failed", "running", "done"]) == 1
        assert not await state.redis.exists(state.names.group_buffer("failed"))
        assert await state.redis.hlen(state.names.group_buffer("running")) == 1
        assert await state.redis.hlen(state.names.group_buffer("done")) == 2  # ready: kept for its batch
        assert await state.get_int(st.LATE_SAMPLES_DROPPED) == 1

    in_redis(scenario)


def test_groups_of_an_older_coordinator_are_adopted_at_the_current_version(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
        await state.redis.sadd(state.key(st.INFLIGHT), "legacy")  # in flight, no inflight_info
        await issue(groups, ("recorded", 5))
        assert await groups.adopt_untracked(3, time.time()) == 1
        assert await groups.fail("legacy", st.GROUPS_DEAD) and await groups.fail("recorded", st.GROUPS_DEAD)
        assert sorted(await groups.owed()) == [3, 5]

    in_redis(scenario)
