"""A batch of a 1,000 H200-equivalent fleet at a 30 s step (~18,000 samples) built by the real coordinator
BatchBuilder against a real redis-server of the test's own, published as a manifest and fetched by the learner's
real read code: no stream entry above 16 MB, no command the builder sends above 16 MB, every reply of the fetch
within its budget, the fetched batch exactly what was scored. The records are as large as the rollout worker
writes them (a run id, ids, payload keys, three trace contexts, timings, dataset metadata); short trajectories
keep Redis at tens of MB (the manifest does not grow with tokens). Prints the wall times and the longest
command Redis ran (SLOWLOG)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamrl.common.batch_payloads import MissingPayloadError, fetch_batch, load_manifest
from streamrl.common.bus import Bus, connect
from streamrl.common.codec import decode, encode
from streamrl.common.messages import (
    MANIFEST_PART_BYTES,
    BatchManifest,
    ScoredRecord,
    ScoredTrajectory,
    Tensor,
    Trajectory,
)
from streamrl.common.payloads import assemble, record_of
from streamrl.common.streams import StreamNames
from streamrl.coordinator.batches import BatchBuilder
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.state import RunState
from streamrl.ops.redis_server import RedisServer

GROUPS, GROUP_SIZE = 1125, 16  # 18,000 samples
TOKENS = 200
MIB = 2**20
BUDGET = 1 * MIB
ENTRY_LIMIT = 16 * MIB
METADATA = {"source": "openai/gsm8k", "split": "train", "difficulty": "medium", "row": 123_456, "answer_chars": 180}


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[str]:
    server = RedisServer(tmp_path / "redis", appendonly=False).start()
    yield server.url
    server.stop()


class MeasuredBus(Bus):
    """The builder's bus, recording the bulk bytes and wall time of every transaction it sends (one command) and
    how many payloads each renames; ``killed_after``: the process dies (an exception) instead of sending the
    transaction after that many."""

    def __init__(self, redis: Any, killed_after: int | None = None) -> None:
        super().__init__(redis)
        self.commands: list[tuple[int, float]] = []
        self.renames: list[int] = []
        self.killed_after = killed_after

    async def run_tx_script(self, keys: list[str], args: list[Any]) -> Any:
        if self.killed_after is not None and len(self.commands) >= self.killed_after:
            raise SystemExit("coordinator killed between two transactions")
        size = sum(len(str(v)) if not isinstance(v, bytes) else len(v) for v in [*keys, *args])
        self.renames.append(sum(1 for v in args if v in ("RENAME", b"RENAME")))
        started = time.perf_counter()
        try:
            return await super().run_tx_script(keys, args)
        finally:
            self.commands.append((size, time.perf_counter() - started))


def traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


class CountingRedis:
    """The test's client, recording the bulk bytes of every pipelined reply (the learner's reads)."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.replies: list[int] = []
        self.pipelines: list[int] = []

    def pipeline(self, transaction: bool = False) -> Any:
        pipe = self.redis.pipeline(transaction=transaction)
        real = pipe.execute

        async def execute() -> list[Any]:
            out = await real()
            sizes = [len(r) if isinstance(r, bytes) else sum(len(v) for v in r if v is not None) for r in out]
            self.replies += sizes
            self.pipelines.append(sum(sizes))
            return list(out)

        pipe.execute = execute
        return pipe


def sample(group: int, index: int) -> Trajectory:
    traj = Trajectory(
        id=f"p{group}/{index}",
        group_id=f"p{group}",
        group_index=index,
        group_size=GROUP_SIZE,
        prompt_ids=Tensor.from_list(list(range(32)), "int32"),
        response_ids=Tensor.from_list([(group * 31 + index + t) % 50_000 for t in range(TOKENS)], "int32"),
        logprobs=Tensor.from_list([-0.01 * (t % 97) for t in range(TOKENS)], "float32"),
        loss_mask=Tensor.from_list([1] * TOKENS, "uint8"),
        policy_version_start=0,
        policy_version_end=1,
        finish_reason="length",
        truncated=True,
        metadata=dict(METADATA, row=group),
        timings={"queue_s": 0.123, "generate_s": 29.7, "started_at": time.time()},
        traceparent=traceparent(),
    )
    return traj


async def score_groups(groups: GroupBuffer, num_groups: int = GROUPS) -> tuple[dict[str, ScoredTrajectory], int]:
    """Issue and complete every group, each payload written as the rollout worker writes it and each scored
    record as the scored consumer does: the samples as the learner must train them, and the payloads' bytes."""
    state, scored = groups.state, {}
    tx = state.tx()
    for g in range(num_groups):
        groups.queue_issue(tx, f"p{g}", 0, time.time())
    await tx.execute()
    payload_bytes = 0
    pipe = state.redis.pipeline(transaction=False)
    for g in range(num_groups):
        for i in range(GROUP_SIZE):
            traj = sample(g, i)
            payload = encode(traj)
            payload_bytes += len(payload)
            record = record_of(traj, state.names.payload(traj.id, secrets.token_hex(8)), len(payload))
            s = ScoredRecord(
                trajectory=record,
                reward=float(i % 2),
                score=float(i % 2),
                scorer="math_verify",
                reward_latency_ms=3.2,
                traceparent=traceparent(),
            )
            scored[traj.id] = assemble(s, traj)
            pipe.set(record.payload_key, payload)
            pipe.hset(state.names.group_buffer(f"p{g}"), traj.id, encode(s))
    await pipe.execute()
    await groups.complete(None)
    return scored, payload_bytes


@pytest.mark.timeout(600)
def test_an_18000_sample_batch_travels_by_reference_no_entry_over_16_mb(own_redis: str) -> None:
    async def scenario(state: RunState, bus: MeasuredBus) -> None:
        groups = GroupBuffer(state, group_size=GROUP_SIZE, dynamic_filtering=False)
        scored, payload_bytes = await score_groups(groups)
        assert payload_bytes > 30 * MIB  # the batch as one entry would be over 30 MB (2 GB at 8k tokens)

        build = BatchBuilder(state, groups, prompts_per_step=GROUPS, max_staleness=0, drop_stale=True)
        await state.redis.config_set("slowlog-log-slower-than", 0)
        await state.redis.config_set("slowlog-max-len", 100_000)
        await state.redis.slowlog_reset()
        bus.commands.clear()
        started = time.perf_counter()
        (built,) = await build.build(version=0)
        print(f"built and published in {time.perf_counter() - started:.2f} s")
        slowest = max(await state.redis.slowlog_get(100_000), key=lambda e: e["duration"])
        await state.redis.config_set("slowlog-log-slower-than", 10_000)
        size, took = max(bus.commands)
        print(
            f"largest transaction {size / MIB:.2f} MiB, {took * 1000:.0f} ms wall; longest command in Redis "
            f"{slowest['duration'] / 1000:.1f} ms ({slowest['command'][:40]!r})"
        )
        assert len(built.batch.samples) == GROUPS * GROUP_SIZE
        assert all(size <= ENTRY_LIMIT for size, _ in bus.commands)
        # moved in pieces: no transaction renames more than batch_tx_samples payloads (256 by default)
        print(f"{len(bus.renames)} transactions, at most {max(bus.renames)} renames in one")
        assert sum(bus.renames) == GROUPS * GROUP_SIZE and max(bus.renames) <= build.tx_samples == 256

        for stream in (state.names.batches, state.names.dead, state.names.scored):
            for _, fields in await state.redis.xrange(stream):
                assert len(fields[b"d"]) <= ENTRY_LIMIT
        ((_, fields),) = await state.redis.xrange(state.names.batches)
        print(f"payloads {payload_bytes / MIB:.1f} MiB, manifest entry {len(fields[b'd']) / MIB:.3f} MiB")
        manifest = decode(fields[b"d"], BatchManifest)
        assert manifest.parts and not manifest.samples and manifest.num_samples == GROUPS * GROUP_SIZE
        assert max(manifest.part_bytes) <= MANIFEST_PART_BYTES and len(fields[b"d"]) <= MANIFEST_PART_BYTES
        for key in manifest.parts:
            assert await state.redis.ttl(key) == -1  # persisted by the batch's transaction

        client = CountingRedis(state.redis)
        started = time.perf_counter()
        whole = await load_manifest(client, manifest, max_reply_bytes=BUDGET)
        print(
            f"manifest: {len(manifest.parts)} parts, {sum(manifest.part_bytes) / MIB:.2f} MiB of refs "
            f"({sum(manifest.part_bytes) / manifest.num_samples:.0f} B a sample), read in {len(client.pipelines)} reads"
        )
        assert whole.samples == built.manifest.samples
        parts_read = sum(client.pipelines)
        fetched = await fetch_batch(client, whole, max_reply_bytes=BUDGET)
        print(f"fetched in {time.perf_counter() - started:.2f} s, {len(client.pipelines)} reads")
        assert max(client.pipelines) <= BUDGET and max(client.replies) <= BUDGET
        assert sum(client.pipelines) - parts_read == payload_bytes
        assert (fetched.id, fetched.index) == (built.batch.id, built.batch.index)
        assert sorted(s.trajectory.id for s in fetched.samples) == sorted(scored)
        assert all(s == scored[s.trajectory.id] for s in fetched.samples)
        groups_in_order = [s.trajectory.group_id for s in fetched.samples]
        assert all(groups_in_order.count(g) == GROUP_SIZE for g in set(groups_in_order[:100]))

        # the payloads live until the batch is trained (the learner deletes them) or counted dead: here, from the
        # header alone (what a dead letter holds): its parts are read for the payloads they name
        assert await build.record_dead(manifest.id, manifest.num_samples, GROUPS, "test", manifest.buffers)
        assert not any([await state.redis.exists(k) for k in [*whole.buffers[:50], *whole.buffers[-50:]]])
        with pytest.raises(MissingPayloadError, match=r"batch-0: \d+ of its \d+ manifest parts missing in Redis"):
            await fetch_batch(state.redis, manifest, max_reply_bytes=BUDGET)
        with pytest.raises(
            MissingPayloadError,
            match=r"batch-0: payloads missing in Redis \(\d+ of the \d+ samples of one read; first: p",
        ):
            await fetch_batch(state.redis, whole, max_reply_bytes=BUDGET)

    async def main() -> None:
        client = connect(own_redis)
        bus = MeasuredBus(client)
        try:
            await scenario(RunState(bus, StreamNames(f"run-{secrets.token_hex(6)}")), bus)
        finally:
            await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("killed_after", [1, 2, 5, 11])
def test_a_batch_moved_in_pieces_is_finished_by_the_next_coordinator(own_redis: str, killed_after: int) -> None:
    """The coordinator dies after the building record (1), after a piece (2, 5) or before the publishing
    transaction (11: the record and 10 pieces of 64 samples): the next one publishes the batch once, whole."""
    num_groups = 40  # 640 samples, 10 pieces of 64

    async def main() -> None:
        client = connect(own_redis)
        names = StreamNames(f"run-{secrets.token_hex(6)}")
        try:
            bus = MeasuredBus(client)
            state = RunState(bus, names)
            groups = GroupBuffer(state, group_size=GROUP_SIZE, dynamic_filtering=False)
            scored, _ = await score_groups(groups, num_groups)
            bus.killed_after = len(bus.commands) + killed_after
            first = BatchBuilder(
                state, groups, prompts_per_step=num_groups, max_staleness=0, drop_stale=True, tx_samples=64
            )
            with pytest.raises(SystemExit):
                await first.build(version=0)
            assert not await client.xlen(names.batches)
            assert await client.exists(names.state("building"))

            state = RunState(MeasuredBus(client), names)  # the next coordinator: its own view, the same Redis
            groups = GroupBuffer(state, group_size=GROUP_SIZE, dynamic_filtering=False)
            after = BatchBuilder(
                state, groups, prompts_per_step=num_groups, max_staleness=0, drop_stale=True, tx_samples=64
            )
            assert await after.build(version=0) == []  # the batch it finished is not one it built
            assert await after.build(version=0) == []
            ((_, fields),) = await client.xrange(names.batches)
            manifest = decode(fields[b"d"], BatchManifest)
            assert (manifest.id, manifest.index) == ("batch-0", 0)
            assert await state.get_int("batch_index") == 1
            assert not await client.exists(names.state("building"))
            assert not await client.llen(names.state("ready"))
            assert not [k async for k in client.scan_iter(match=names.group_buffer("*"))]
            assert not [k async for k in client.scan_iter(match=names.payload("*", "*"))]
            fetched = await fetch_batch(client, manifest, max_reply_bytes=BUDGET)
            assert sorted(s.trajectory.id for s in fetched.samples) == sorted(scored)
            assert all(s == scored[s.trajectory.id] for s in fetched.samples)
        finally:
            await client.aclose()

    asyncio.run(main())
