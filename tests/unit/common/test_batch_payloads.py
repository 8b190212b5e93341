"""A batch by reference: the manifest stays small whatever the payloads weigh, reads and commit calls are
planned within their byte budget, in order, nothing left out."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.common.batch_payloads import (
    MissingPayloadError,
    fetch_batch,
    manifest_of,
    owned_buffers,
    plan_reads,
    resolve,
    route,
    split_refs,
)
from streamrl.common.bus import MAX_COMMITS_PER_CALL, CommitBatcher, take_commits
from streamrl.common.codec import decode, encode
from streamrl.common.lanes import LaneClients, lane_names
from streamrl.common.messages import BatchManifest, ManifestPart, ScoredTrajectory, Tensor, TrainingBatch, Trajectory
from streamrl.common.streams import StreamNames

MIB = 2**20


def scored(group: int, index: int, tokens: int = 4) -> ScoredTrajectory:
    traj = Trajectory(
        id=f"run-p{group}/{index}",
        group_id=f"run-p{group}",
        group_index=index,
        group_size=16,
        prompt_ids=Tensor.from_list([1, 2], "int32"),
        response_ids=Tensor.from_list([7] * tokens, "int32"),
        logprobs=Tensor.from_list([-0.5] * tokens, "float32"),
        loss_mask=Tensor.from_list([1] * tokens, "uint8"),
        policy_version_start=3,
    )
    return ScoredTrajectory(trajectory=traj, reward=1.0)


def test_a_manifest_of_18000_samples_of_8k_tokens_is_far_below_16_mb() -> None:
    names = StreamNames("run-with-a-longish-name")
    samples = [scored(g, i) for g in range(1125) for i in range(16)]
    batch = TrainingBatch(id="batch-7", index=7, samples=samples, policy_version=9, staleness=[4] * len(samples))
    keys = [names.batched_samples("batch-7", s.trajectory.group_id) for s in samples]
    sizes = [111 * 1024] * len(samples)  # what the samples would weigh at 8,192 tokens: ~2 GB in all
    manifest = manifest_of(batch, keys, sizes)
    wire = encode(manifest)
    assert len(wire) < 4 * MIB, len(wire)
    back = decode(wire, BatchManifest)
    assert back == manifest and back.buffers == list(dict.fromkeys(keys)) and len(back.buffers) == 1125
    assert [r.trajectory_id for r in back.samples] == [s.trajectory.id for s in samples]
    assert {r.policy_version_start for r in back.samples} == {3} and back.staleness == batch.staleness
    assert resolve(back, samples) == batch  # the manifest and its payloads make the batch again


def test_a_manifest_needs_one_key_and_size_per_sample() -> None:
    batch = TrainingBatch(
        id="batch-0", index=0, samples=[scored(0, 0), scored(0, 1)], policy_version=0, staleness=[0, 0]
    )
    with pytest.raises(ValueError, match="batch-0: 2 samples but 1 keys and 2 sizes"):
        manifest_of(batch, ["k"], [1, 2])


@pytest.mark.parametrize(
    ("sizes", "budget", "reads"),
    [
        ([], 10, []),
        ([3, 3, 3, 3], 6, [range(0, 2), range(2, 4)]),
        ([3, 3, 3, 3], 7, [range(0, 2), range(2, 4)]),
        ([3, 3, 3, 3], 100, [range(0, 4)]),
        ([2, 9, 2], 5, [range(0, 1), range(1, 2), range(2, 3)]),  # one bigger than the budget: alone
        ([5, 5], 5, [range(0, 1), range(1, 2)]),
    ],
)
def test_reads_cover_every_sample_once_in_order_within_the_budget(
    sizes: list[int], budget: int, reads: list[range]
) -> None:
    planned = plan_reads(sizes, budget)
    assert planned == reads
    assert [i for r in planned for i in r] == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in r) <= budget or len(r) == 1 for r in planned)


def test_a_read_budget_below_one_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="max_bytes must be at least 1, got 0"):
        plan_reads([1], 0)


@pytest.mark.parametrize(
    ("sizes", "budget", "taken"),
    [
        ([], 10, 0),
        ([4, 4, 4], 8, 2),
        ([4, 4, 4], 100, 3),
        ([20, 1], 8, 1),  # a commit above the budget goes alone
        ([1] * 1000, 10**9, MAX_COMMITS_PER_CALL),  # and never more commits than the count cap
    ],
)
def test_a_commit_call_is_capped_by_bytes_and_by_count(sizes: list[int], budget: int, taken: int) -> None:
    assert take_commits(sizes, budget) == taken


def test_only_the_hashes_named_under_a_batchs_own_id_are_its_to_delete() -> None:
    names = StreamNames("r")
    mine = [names.batched_samples("batch-1", "g1"), names.batched_samples("batch-1", "g2")]
    others = [names.batched_samples("batch-10", "g3"), names.batched_samples("batch-0", "g4"), names.group_buffer("g5")]
    assert owned_buffers(names, "batch-1", [*mine, *others]) == mine
    assert owned_buffers(names, "batch-1-other", mine) == []  # a conflicting copy deletes nothing of batch-1


class RecordingBus:
    """A bus that records the commits of each script call (the unit tier has no Redis)."""

    def __init__(self, max_command_bytes: int) -> None:
        self.max_command_bytes = max_command_bytes
        self.calls: list[int] = []

    def commit_args(self, outputs: list[bytes], **_: object) -> list[str | bytes | int]:
        return list(outputs)

    async def run_commits(self, commits: list[list[str | bytes | int]]) -> list[int]:
        self.calls.append(len(commits))
        return [1] * len(commits)


def test_the_commit_batcher_splits_calls_by_bytes() -> None:
    bus = RecordingBus(max_command_bytes=3 * 1000)

    async def main() -> list[bool]:
        batcher = CommitBatcher(bus)  # type: ignore[arg-type]
        return await asyncio.gather(*(batcher.commit([b"x" * 1000]) for _ in range(7)))

    assert asyncio.run(main()) == [True] * 7
    assert bus.calls == [3, 3, 1]


def test_split_refs_keeps_every_ref_once_in_order_in_parts_within_the_budget() -> None:
    names = StreamNames("run")
    samples = [scored(g, i) for g in range(40) for i in range(16)]
    batch = TrainingBatch(id="batch-1", index=1, samples=samples, policy_version=1, staleness=[0] * len(samples))
    refs = manifest_of(batch, [names.batched_samples("batch-1", s.trajectory.id) for s in samples], [9] * 640).samples
    budget = 8 * 1024
    runs = split_refs(refs, budget)
    assert len(runs) > 1 and [r for run in runs for r in run] == refs
    assert all(
        len(encode(ManifestPart(batch_id="batch-1", number=n, samples=run))) <= budget + 64
        for n, run in enumerate(runs)
    )
    assert split_refs(refs, 10 * 2**20) == [refs]  # all fit: one part (the manifest is published whole)


class FakeRedis:
    """An in-memory Redis of strings and hashes answering pipelines of GET / HMGET (the unit tier has no Redis);
    records the keys each pipeline read."""

    def __init__(self, data: dict[str, object]) -> None:
        self.data = data
        self.reads: list[list[str]] = []

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        return FakePipeline(self)


class FakePipeline:
    def __init__(self, redis: FakeRedis) -> None:
        self.redis = redis
        self.calls: list[tuple[str, list[str]]] = []

    def get(self, key: str) -> None:
        self.calls.append((key, []))

    def hmget(self, key: str, fields: list[str]) -> None:
        self.calls.append((key, fields))

    async def execute(self) -> list[object]:
        self.redis.reads.append([key for key, _ in self.calls])
        out: list[object] = []
        for key, fields in self.calls:
            value = self.redis.data.get(key)
            out.append([value.get(f) if isinstance(value, dict) else None for f in fields] if fields else value)
        return out


def test_a_joined_manifests_parts_and_payloads_are_each_read_from_the_redis_of_their_lane() -> None:
    home_names, lane0, lane1 = StreamNames("r"), lane_names("r", 0), lane_names("r", 1)
    samples = [scored(g, i) for g in range(4) for i in range(2)]
    batch = TrainingBatch(id="batch-0", index=0, samples=samples, policy_version=1, staleness=[0] * len(samples))
    # groups 0 and 2 in lane 0, 1 and 3 in lane 1 (interleaved: the order of the manifest is kept)
    keys = [(lane0 if int(s.trajectory.group_id[5:]) % 2 == 0 else lane1) for s in samples]
    hashes = [n.batched_samples("batch-0", s.trajectory.group_id) for n, s in zip(keys, samples, strict=True)]
    data: dict[str, dict[str, object]] = {"home": {}, "lane0": {}, "lane1": {}}
    for n, key, s in zip(keys, hashes, samples, strict=True):
        data["lane0" if n is lane0 else "lane1"].setdefault(key, {})[s.trajectory.id] = encode(s)
    whole = manifest_of(batch, hashes, [100] * len(samples))
    runs = split_refs(whole.samples, 600)
    assert len(runs) >= 2
    parts = [home_names.manifest_part("batch-0", "a", n) for n in range(len(runs))]
    for n, (key, run) in enumerate(zip(parts, runs, strict=True)):
        data["home"][key] = encode(ManifestPart(batch_id="batch-0", number=n, samples=run))
    header = BatchManifest(
        id="batch-0",
        index=0,
        samples=[],
        policy_version=1,
        staleness=[0] * len(samples),
        parts=parts,
        part_bytes=[len(data["home"][k]) for k in parts],  # type: ignore[arg-type]
    )
    home, a, b = FakeRedis(data["home"]), FakeRedis(data["lane0"]), FakeRedis(data["lane1"])
    clients = LaneClients(home, [a, b])

    got = asyncio.run(fetch_batch(clients, header, max_reply_bytes=10**6))

    assert got == batch  # whole, in the manifest's order
    assert [k for read in home.reads for k in read] == parts
    assert {k for read in a.reads for k in read} == {h for n, h in zip(keys, hashes, strict=True) if n is lane0}
    assert {k for read in b.reads for k in read} == {h for n, h in zip(keys, hashes, strict=True) if n is lane1}
    # lane 1's Redis lost one payload: the batch is not trained short
    del data["lane1"][hashes[2]]
    with pytest.raises(MissingPayloadError, match=r"batch-0: payloads missing in Redis \(2 of the 8 samples"):
        asyncio.run(fetch_batch(clients, header, max_reply_bytes=10**6))


def test_reads_are_routed_by_lane_one_group_per_client_in_order() -> None:
    home, a, b = object(), object(), object()
    clients = LaneClients(home, [a, b, a])  # lanes 0 and 2 on one Redis: one client
    keys = [lane_names("r", 1).prompts, StreamNames("r").dead, lane_names("r", 2).dead, lane_names("r", 0).dead]
    assert route(clients, keys) == [(b, [0]), (home, [1]), (a, [2, 3])]
    assert route(LaneClients(home, []), keys[:2]) == [(home, [0, 1])]  # no lanes: the one client


def test_a_batchs_own_hashes_are_those_under_its_id_in_the_home_or_any_lane() -> None:
    names = StreamNames("r")
    mine = [
        names.batched_samples("batch-1", "g"),
        *(lane_names("r", k).batched_samples("batch-1", "g") for k in (0, 1)),
    ]
    others = [lane_names("r", 2).batched_samples("batch-1", "g"), lane_names("r", 0).batched_samples("batch-10", "g")]
    assert owned_buffers(names, "batch-1", [*mine, *others], lanes=2) == mine  # lane 2 is not the run's
    assert owned_buffers(names, "batch-1", [*mine, *others]) == mine[:1]  # no lanes: the home's alone
