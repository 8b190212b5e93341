"""Prompt issuing against a real Redis: each prompt goes out with its group recorded in flight, and a
replacement asks for the version its lost group needed."""

from __future__ import annotations

import pytest
from coordinator_fakes import Prompts, config, sample, store

from streamrl.common.codec import decode, encode
from streamrl.common.messages import PromptWorkItem, WeightsPublished
from streamrl.coordinator import state as st
from streamrl.coordinator.groups import GroupBuffer, InFlight
from streamrl.coordinator.issuing import PromptIssuer
from streamrl.coordinator.state import RunState


def issuer(state: RunState, **fields: object) -> PromptIssuer:
    cfg = config(group_size=2, prompts_per_step=2, max_staleness=0, prefetch_steps=1, **fields)
    groups = GroupBuffer(state, group_size=2, dynamic_filtering=False)
    return PromptIssuer(cfg, state, groups, Prompts())  # type: ignore[arg-type]


async def issued(state: RunState) -> list[PromptWorkItem]:
    return [decode(f[b"d"], PromptWorkItem) for _, f in await state.redis.xrange(state.names.prompts)]


def test_each_prompt_goes_out_with_its_group_recorded_in_flight(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        prompts = issuer(state, wait_for_learner=False)
        assert await prompts.issue(version=0) == 4
        assert await prompts.issue(version=0) == 0  # admission: batches 0 and 1 only
        items = await issued(state)
        assert [(p.id, p.policy_version) for p in items] == [("p0", 0), ("p1", 0), ("p2", 1), ("p3", 1)]
        info = {
            g.decode(): InFlight.parse(v) for g, v in (await state.redis.hgetall(state.key(st.INFLIGHT_INFO))).items()
        }
        assert {g: i.required_version for g, i in info.items()} == {"p0": 0, "p1": 0, "p2": 1, "p3": 1}
        assert info["p0"].issued_at == pytest.approx(items[0].issued_at, abs=1e-3)
        assert await state.get_int(st.CURSOR) == 4

    in_redis(scenario)


def test_a_replacement_inherits_the_version_of_the_group_it_replaces(in_redis) -> None:  # type: ignore[no-untyped-def]
    """Synchronous, one batch prefetched: batch 0 is p0, p1 and batch 1 (p2, p3) waits for version 1.
    p1 dies. Admission places a new group at position accepted + in_flight = 1 + 2 = 3, i.e. in batch
    1, needing version 1 - which needs batch 0 trained, which needs p1's replacement: a deadlock."""

    async def scenario(state: RunState) -> None:
        prompts = issuer(state, wait_for_learner=False)
        await prompts.issue(version=0)
        await store(state, "p0", sample("p0", 0, 1.0), sample("p0", 1, 0.0))
        await prompts.groups.complete(None)
        assert await prompts.groups.fail("p1", st.GROUPS_DEAD)
        assert await prompts.issue(version=0) == 1
        replacement = (await issued(state))[-1]
        assert (replacement.id, replacement.policy_version) == ("p4", 0)
        assert await prompts.groups.owed() == [], "the owed version was used once"
        assert await prompts.issue(version=0) == 0

    in_redis(scenario)


def test_no_prompt_before_a_learner_published_its_weights(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> None:
        prompts = issuer(state)
        assert await prompts.issue(version=0) == 0
        ready = WeightsPublished(version=0, step=0, batch_id="", checksum="0", num_bytes=0, num_buckets=0, endpoint="")
        await state.redis.xadd(state.names.weights, {b"d": encode(ready)})
        assert await prompts.issue(version=0) == 4

    in_redis(scenario)


def test_a_bad_row_is_skipped_counted_and_the_cursor_moves_past_it(in_redis, caplog) -> None:  # type: ignore[no-untyped-def]
    from streamrl.coordinator.prompts import BadRowError, Prompt

    class OneBadRow(Prompts):
        def get(self, cursor: int) -> Prompt:
            if cursor == 1:
                raise BadRowError("dataset d.jsonl row 1: no key 'prompt' (keys: ['question'])")
            return super().get(cursor)

    async def scenario(state: RunState) -> None:
        cfg = config(group_size=2, prompts_per_step=2, max_staleness=0, prefetch_steps=1, wait_for_learner=False)
        prompts = PromptIssuer(cfg, state, GroupBuffer(state, group_size=2, dynamic_filtering=False), OneBadRow())  # type: ignore[arg-type]
        assert await prompts.issue(version=0) == 3
        assert await prompts.issue(version=0) == 1  # the fourth slot goes to the next good row
        assert [p.id for p in await issued(state)] == ["p0", "p2", "p3", "p4"]
        assert (await state.get_int(st.CURSOR), await state.get_int(st.PROMPTS_BAD)) == (5, 1)

    in_redis(scenario)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == ["skipping dataset d.jsonl row 1: no key 'prompt' (keys: ['question'])"]
