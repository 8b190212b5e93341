"""Payload once, references after, against a real redis-server of the test's own (its byte counters are this
test's alone): the rollout worker's commit (:func:`streamrl.common.payloads.store_payloads` + the commit script),
the real reward service (payload heads fetched, ScoredRecords out), the coordinator's real group buffer and batch
builder, the learner's real fetch. Per trajectory Redis takes in about the payload once and sends it out about
once (the reward tier reads only the head - text, label, metadata, turns - the learner the whole); no script call
carries a payload; the learner trains exactly what was scored; a reward function is given exactly what it was
given a whole Trajectory. Plus the fences: a fenced-out worker's late payload never changes what was committed,
an uncommitted payload expires."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import redis as syncredis

from streamrl.common.batch_payloads import fetch_batch
from streamrl.common.bus import Bus, Output, connect
from streamrl.common.codec import decode, encode
from streamrl.common.messages import (
    BatchManifest,
    PromptWorkItem,
    ScoredRecord,
    ScoredTrajectory,
    Tensor,
    Trajectory,
    TrajectoryRecord,
    Turn,
)
from streamrl.common.payload_format import unpack_payload
from streamrl.common.payloads import store_payloads
from streamrl.common.streams import StreamNames
from streamrl.coordinator.batches import BatchBuilder
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.state import RunState
from streamrl.ops.redis_server import RedisServer
from streamrl.reward.config import RewardConfig
from streamrl.reward.scorers.base import ScorerResult
from streamrl.reward.service import MissingPayloadError, RedisPayloads, RewardService

GROUPS, GROUP_SIZE, TOKENS = 4, 4, 8192


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[str]:
    server = RedisServer(tmp_path / "redis", appendonly=False).start()
    yield server.url
    server.stop()


class ParityScorer:
    """Reward = the response text's length modulo 2 (a scorer that reads text, as reward functions do)."""

    reads_tokens = False
    name = "parity"

    async def score(self, batch: list[Trajectory]) -> ScorerResult:
        values = [float(len(t.response_text) % 2) for t in batch]
        return ScorerResult(rewards=values, scores=values, extra=[{} for _ in batch])

    def metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        pass


def trajectory(group: int, index: int) -> Trajectory:
    rng = np.random.default_rng(group * 100 + index)
    return Trajectory(
        id=f"p{group}/{index}",
        group_id=f"p{group}",
        group_index=index,
        group_size=GROUP_SIZE,
        prompt_ids=Tensor.from_list(list(range(64)), "int32"),
        response_ids=Tensor.from_numpy(rng.integers(0, 150_000, TOKENS, dtype=np.int32)),
        logprobs=Tensor.from_numpy(rng.standard_normal(TOKENS).astype(np.float32)),
        loss_mask=Tensor.from_numpy(np.ones(TOKENS, dtype=np.uint8)),
        response_text="y" * (2000 + group * GROUP_SIZE + index),
    )


def net_bytes(client: syncredis.Redis) -> tuple[int, int]:
    stats = client.info("stats")
    return int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])


async def read_one(bus: Bus, stream: str, group: str) -> tuple[str, bytes]:
    ((_, entries),) = await bus.redis.xreadgroup(group, "c", {stream: ">"}, count=1)
    entry_id, fields = entries[0]
    return entry_id.decode(), fields[b"d"]


@pytest.mark.timeout(300)
def test_each_payload_enters_redis_once_and_leaves_about_once_never_through_a_script(
    own_redis: str, run_id: str
) -> None:
    names = StreamNames(run_id)
    sync = syncredis.Redis.from_url(own_redis)

    async def main() -> None:
        bus = Bus(connect(own_redis), max_command_bytes=256 * 1024)
        script_args: list[int] = []
        commit = bus._commit

        async def counting_commit(*, keys: list[str], args: list[Any]) -> Any:
            script_args.append(max(len(a) if isinstance(a, bytes | str) else 0 for a in args))
            return await commit(keys=keys, args=args)

        bus._commit = counting_commit  # type: ignore[method-assign]
        for stream, group in ((names.prompts, "rollout"), (names.trajectories, "reward"), (names.scored, "coord")):
            await bus.redis.xgroup_create(stream, group, id="0", mkstream=True)
        reward = RewardService(
            RewardConfig(scorers=[{"type": "function", "name": "parity", "path": "unused.py"}], max_wait_ms=5),
            names,
            scorers=[ParityScorer()],
            payloads=RedisPayloads(bus.redis, bus.max_command_bytes),
        )
        state = RunState(bus, names)
        groups = GroupBuffer(state, group_size=GROUP_SIZE, dynamic_filtering=False)
        tx = state.tx()
        for g in range(GROUPS):
            groups.queue_issue(tx, f"p{g}", 0, time.time())
        await tx.execute()
        generated = {f"p{g}/{i}": trajectory(g, i) for g in range(GROUPS) for i in range(GROUP_SIZE)}
        payload_bytes = sum(len(encode(t)) for t in generated.values())
        before = net_bytes(sync)

        # rollout: one prompt per group, its samples' payloads SET, their records committed with the ack
        for g in range(GROUPS):
            item = PromptWorkItem(id=f"p{g}", prompt_ids=Tensor.from_list([1], "int32"))
            await bus.redis.xadd(names.prompts, {"d": encode(item)})
            entry, _ = await read_one(bus, names.prompts, "rollout")
            outputs = await store_payloads(bus, names, [generated[f"p{g}/{i}"] for i in range(GROUP_SIZE)])
            assert await bus.commit(outputs, ack_stream=names.prompts, ack_group="rollout", ack_entry=entry)
        # reward: records in, payloads fetched, scored records out
        for _ in generated:
            entry, raw = await read_one(bus, names.trajectories, "reward")
            assert len(raw) < 2048, "a record, not a payload"
            outputs = await reward.handle(decode(raw, TrajectoryRecord))
            assert await bus.commit(outputs, ack_stream=names.trajectories, ack_group="reward", ack_entry=entry)
        # coordinator: the scored records stored in their groups (as its handler does), one batch built
        for _ in generated:
            entry, raw = await read_one(bus, names.scored, "coord")
            scored = decode(raw, ScoredRecord)
            assert len(raw) < 2048 and scored.trajectory.payload_key.startswith(names.payload(scored.trajectory.id, ""))
            out = Output(key=names.group_buffer(scored.trajectory.group_id), field=scored.trajectory.id, message=scored)
            assert await bus.commit([out], ack_stream=names.scored, ack_group="coord", ack_entry=entry)
        await groups.complete(None)
        build = BatchBuilder(state, groups, prompts_per_step=GROUPS, max_staleness=0, drop_stale=True)
        (built,) = await build.build(version=0)
        ((_, fields),) = await bus.redis.xrange(names.batches)
        manifest = decode(fields[b"d"], BatchManifest)
        # learner: the payloads the manifest names, fetched and assembled
        batch = await fetch_batch(bus.redis, manifest, max_reply_bytes=bus.max_command_bytes)
        after = net_bytes(sync)

        taken_in, sent_out = after[0] - before[0], after[1] - before[1]
        print(
            f"payloads {payload_bytes / 2**20:.2f} MiB: Redis took in {taken_in / payload_bytes:.3f}x, "
            f"sent out {sent_out / payload_bytes:.3f}x; largest script argument {max(script_args)} B"
        )
        assert payload_bytes <= taken_in <= 1.1 * payload_bytes
        # the learner's read of the whole payload, the reward's of its head (text, here ~3% of the payload)
        assert payload_bytes <= sent_out <= 1.1 * payload_bytes
        assert max(script_args) < 4096, "no payload travels as a script argument"
        # the learner trains exactly what was scored: every token, log-prob and reward
        assert [s.trajectory.id for s in batch.samples] == [s.trajectory.id for s in built.batch.samples]
        for sample in batch.samples:
            original = generated[sample.trajectory.id]
            assert sample.trajectory.response_ids == original.response_ids
            assert sample.trajectory.logprobs == original.logprobs
            assert sample.trajectory == original
            assert sample.reward == float(len(original.response_text) % 2)
        # nothing but the batched payloads is left holding tokens
        assert not [k for k in await bus.redis.keys(names.payload_prefix + "*")]
        await reward.close()
        await bus.redis.aclose()

    asyncio.run(main())


def test_a_fenced_out_workers_late_payload_never_changes_what_was_committed(own_redis: str, run_id: str) -> None:
    names = StreamNames(run_id)

    async def main() -> None:
        bus = Bus(connect(own_redis), payload_orphan_ttl_s=600)
        await bus.redis.xgroup_create(names.prompts, "rollout", id="0", mkstream=True)
        await bus.redis.xadd(names.prompts, {"d": b"x"})
        entry, _ = await read_one(bus, names.prompts, "rollout")
        first, late = trajectory(0, 0), trajectory(9, 9)
        late = Trajectory(**{**{f: getattr(late, f) for f in late.__struct_fields__}, "id": first.id})
        # worker A (lease taken over) wrote its payload; worker B generated the same sample and committed
        stale_outputs = await store_payloads(bus, names, [late])
        outputs = await store_payloads(bus, names, [first])
        assert await bus.commit(outputs, ack_stream=names.prompts, ack_group="rollout", ack_entry=entry)
        # A's late commit finds the entry acked: nothing written; its payload is under a key of its own
        assert not await bus.commit(stale_outputs, ack_stream=names.prompts, ack_group="rollout", ack_entry=entry)
        ((_, fields),) = await bus.redis.xrange(names.trajectories)
        record = decode(fields[b"d"], TrajectoryRecord)
        assert record.payload_key == outputs[0].key != stale_outputs[0].key
        assert unpack_payload(await bus.redis.get(record.payload_key)) == first
        assert await bus.redis.ttl(record.payload_key) == -1, "the commit made the referenced payload permanent"
        orphan_ttl = await bus.redis.ttl(stale_outputs[0].key or "")
        assert 0 < orphan_ttl <= 600, "the uncommitted payload expires"
        await bus.redis.aclose()

    asyncio.run(main())


def test_an_uncommitted_payload_expires_and_a_commit_of_an_expired_one_writes_nothing(
    own_redis: str, run_id: str
) -> None:
    names = StreamNames(run_id)

    async def main() -> None:
        bus = Bus(connect(own_redis), payload_orphan_ttl_s=0.2)
        await bus.redis.xgroup_create(names.prompts, "rollout", id="0", mkstream=True)
        await bus.redis.xadd(names.prompts, {"d": b"x"})
        entry, _ = await read_one(bus, names.prompts, "rollout")
        outputs = await store_payloads(bus, names, [trajectory(0, 0)])
        await asyncio.sleep(0.4)
        assert not await bus.redis.exists(outputs[0].key or "")
        with pytest.raises(Exception, match="payload missing"):
            await bus.commit(outputs, ack_stream=names.prompts, ack_group="rollout", ack_entry=entry)
        assert await bus.redis.xlen(names.trajectories) == 0, "no record of a payload that is gone"
        pending = await bus.redis.xpending(names.prompts, "rollout")
        assert pending["pending"] == 1, "the prompt stays pending: generated again"
        await bus.redis.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("retention_s", [0, 60])
def test_the_learners_ack_deletes_trained_payloads_or_keeps_them_for_the_retention(
    own_redis: str, run_id: str, retention_s: int
) -> None:
    from streamrl.learner.rl.ledger import LearnerLedger

    names = StreamNames(run_id)

    async def main() -> None:
        bus = Bus(connect(own_redis), payload_retention_s=retention_s)
        await bus.redis.xgroup_create(names.batches, "learner", id="0", mkstream=True)
        keys = [names.batched_payload("batch-0", f"p0/{i}") for i in range(3)]
        for key in keys:
            await bus.redis.set(key, b"payload")
        await bus.redis.xadd(names.batches, {"d": b"manifest"})
        entry, _ = await read_one(bus, names.batches, "learner")
        ledger = LearnerLedger(bus, names)
        await ledger.ack(names.batches, [entry], ["batch-0"], acked_from=0, acked_index=1, payloads=keys)
        ttls = [await bus.redis.ttl(k) for k in keys]
        if retention_s:
            assert all(0 < t <= retention_s for t in ttls), ttls  # kept for replay / debugging, then gone
        else:
            assert ttls == [-2, -2, -2], "deleted with the checkpoint-covered ack"
        await bus.redis.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("retention_s", [0, 60])
def test_an_evaluation_payload_goes_with_the_commit_of_its_record_or_lives_the_retention(
    own_redis: str, run_id: str, retention_s: int
) -> None:
    """The commit that stores a scored evaluation record deletes its payload (never trained) - or, with
    ``redis.payload_retention_s``, gives it that long to live (replay, the end-to-end tests' checks)."""
    names = StreamNames(run_id)

    async def main() -> None:
        bus = Bus(connect(own_redis), payload_retention_s=retention_s)
        await bus.redis.xgroup_create(names.prompts, "rollout", id="0", mkstream=True)
        await bus.redis.xadd(names.prompts, {"d": b"x"})
        entry, _ = await read_one(bus, names.prompts, "rollout")
        key = names.payload("e0/0", "aa")
        await bus.redis.set(key, b"payload")
        drop = Output(key=key, op="expire", ttl_ms=retention_s * 1000) if retention_s else Output(key=key, op="delete")
        await bus.commit([drop], ack_stream=names.prompts, ack_group="rollout", ack_entry=entry)
        ttl = await bus.redis.ttl(key)
        if retention_s:
            assert 0 < ttl <= retention_s, ttl
        else:
            assert ttl == -2, "deleted in the commit"
        await bus.redis.aclose()

    asyncio.run(main())


REWARD_FUNC = """
import json

def reward_func(queries, prompts, labels, metadata):
    with open(CALLS, "a") as f:
        f.write(json.dumps({"queries": queries, "prompts": prompts, "labels": labels, "metadata": metadata}) + "\\n")
    return {"rewards": [len(q) / 100 for q in queries], "scores": [float(l == "4") for l in labels]}
"""


def episode(index: int) -> Trajectory:
    """A multi-turn episode: environment rewards per turn, a label, messages in its metadata."""
    base = trajectory(0, index)
    return msgspec.structs.replace(
        base,
        prompt_text=f"Question {index}: what is 2+2?",
        response_text=f"<tool>add 2 2</tool> 4 <answer>{index}</answer>",
        label="4" if index % 2 else "5",
        metadata={"messages": [{"role": "user", "content": f"q{index}"}], "source": "arith", "i": index},
        turns=[Turn(start=0, end=100, policy_version=0, reward=0.25), Turn(start=200, end=TOKENS, policy_version=0)],
    )


def test_a_reward_function_is_given_from_a_payloads_head_exactly_what_a_whole_trajectory_gave_it(
    own_redis: str, run_id: str, tmp_path: Path
) -> None:
    calls = tmp_path / "calls.jsonl"
    func = tmp_path / "reward_fn.py"
    func.write_text(f"CALLS = {str(calls)!r}\n" + REWARD_FUNC)
    names = StreamNames(run_id)
    sync = syncredis.Redis.from_url(own_redis)
    episodes = [episode(i) for i in range(GROUP_SIZE)]

    async def main() -> tuple[list[ScoredRecord], list[ScoredTrajectory], int, int]:
        bus = Bus(connect(own_redis))
        config = RewardConfig(scorers=[{"type": "function", "name": "fn", "path": str(func)}], max_wait_ms=20)
        reward = RewardService(config, names, payloads=RedisPayloads(bus.redis, bus.max_command_bytes))
        try:
            outputs = await store_payloads(bus, names, episodes)
            for out in outputs:
                if out.op == "persist":
                    await bus.redis.persist(out.key or "")
            records = [o.message for o in outputs if isinstance(o.message, TrajectoryRecord)]
            before = net_bytes(sync)[1]
            by_record = await asyncio.gather(*(reward.handle(r) for r in records))
            read = net_bytes(sync)[1] - before
            by_whole = await asyncio.gather(*(reward.handle(t) for t in episodes))
        finally:
            await reward.close()
            await bus.redis.aclose()
        scored = [o.message for (o,) in by_record]
        whole = [o.message for (o,) in by_whole]
        assert all(isinstance(s, ScoredRecord) for s in scored) and all(isinstance(s, ScoredTrajectory) for s in whole)
        return scored, whole, read, sum(r.payload_head_bytes for r in records)  # type: ignore[return-value]

    scored, whole, read, head_bytes = asyncio.run(main())
    first, second = [json.loads(line) for line in calls.read_text().splitlines()]
    assert first == second, "the reward function saw the same queries, prompts, labels and metadata"
    assert first["queries"] == [t.prompt_text + t.response_text for t in episodes]
    assert first["labels"] == [t.label for t in episodes]
    assert first["metadata"] == [t.metadata for t in episodes]
    for s, w in zip(scored, whole, strict=True):
        assert (s.reward, s.score, s.turn_rewards) == (w.reward, w.score, w.turn_rewards)
        assert s.turn_rewards == [0.25, len(w.trajectory.prompt_text + w.trajectory.response_text) / 100]
    # the reward tier read the heads alone (and the replies of one INFO and a few commands): none of the tokens
    # of these 8k-token episodes (~75 KB each)
    assert head_bytes <= read < head_bytes + 4096, (read, head_bytes)


def test_a_missing_payload_head_fails_its_record_alone_naming_the_key(own_redis: str, run_id: str) -> None:
    """GETRANGE answers "" for a key that is gone: the reward tier reports it missing (retried, then dead-lettered
    naming it), never undecodable, and the records fetched with it are scored."""
    names = StreamNames(run_id)

    async def main() -> None:
        bus = Bus(connect(own_redis))
        reward = RewardService(
            RewardConfig(scorers=[{"type": "function", "name": "parity", "path": "unused.py"}], max_wait_ms=20),
            names,
            scorers=[ParityScorer()],
            payloads=RedisPayloads(bus.redis, bus.max_command_bytes),
        )
        try:
            outputs = await store_payloads(bus, names, [trajectory(0, i) for i in range(3)])
            records = [o.message for o in outputs if isinstance(o.message, TrajectoryRecord)]
            assert all(r.payload_head_bytes > 0 for r in records)
            await bus.redis.delete(records[1].payload_key)
            results = await asyncio.gather(*(reward.handle(r) for r in records), return_exceptions=True)
        finally:
            await reward.close()
            await bus.redis.aclose()
        assert isinstance(results[1], MissingPayloadError) and records[1].payload_key in str(results[1])
        for i in (0, 2):
            result = results[i]
            assert isinstance(result, list), result
            (out,) = result
            assert isinstance(out.message, ScoredRecord)
            assert out.message.reward == float(len(trajectory(0, i).response_text) % 2)

    asyncio.run(main())
