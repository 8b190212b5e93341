"""The learner on batches by reference (issue 27): it reads a manifest's payloads itself, trains exactly
what was published, recognises a copy of a consumed batch before reading anything, skips (dead letter,
version published with unchanged weights) a batch whose payloads are missing - never trains it short -
and deletes a batch's payloads with the acknowledgement that a checkpoint allows.

Real redis-server, the real learner service in burst mode (learner_failure_worker.py, one process per life).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import redis
from learner_failure_worker import digest
from test_learner_failures import _life
from test_learner_group import training_batch

from streamrl.common.batch_payloads import manifest_of, split_refs
from streamrl.common.codec import decode, encode
from streamrl.common.lanes import lane_names
from streamrl.common.messages import (
    BATCH_SKIPPED,
    BatchManifest,
    DeadLetter,
    ManifestPart,
    TrainingBatch,
    WeightsPublished,
)
from streamrl.common.streams import StreamNames
from streamrl.ops.redis_server import RedisServer
from streamrl.torchkit.testing import build_tiny_qwen2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("manifests") / "model", hidden_size=64, vocab_size=384)


def publish(
    client: redis.Redis,  # type: ignore[type-arg]
    names: StreamNames,
    batch: TrainingBatch,
    missing: frozenset[str] = frozenset(),
) -> BatchManifest:
    """Store ``batch``'s samples as the coordinator leaves them (one hash per group, under the batch) but those
    in ``missing``, and publish its manifest."""
    keys, sizes = [], []
    for s in batch.samples:
        key, payload = names.batched_samples(batch.id, s.trajectory.group_id), encode(s)
        if s.trajectory.id not in missing:
            client.hset(key, s.trajectory.id, payload)
        keys.append(key)
        sizes.append(len(payload))
    manifest = manifest_of(batch, keys, sizes)
    client.xadd(names.batches, {"d": encode(manifest)})
    return manifest


def test_manifests_are_trained_as_published_a_missing_payload_skips_its_batch_payloads_go_with_the_ack(
    model: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    batches = [training_batch(i) for i in range(3)]
    first = publish(client, names, batches[0])
    # a copy of batch 0 (same ids) whose payloads are nowhere: recognised as a copy before anything is read
    nowhere = [msgspec.structs.replace(r, key=names.batched_samples("batch-0", "nowhere")) for r in first.samples]
    client.xadd(names.batches, {"d": encode(msgspec.structs.replace(first, samples=nowhere))})
    lost = batches[1].samples[3].trajectory.id
    second = publish(client, names, batches[1], missing=frozenset({lost}))
    publish(client, names, batches[2])
    log = tmp_path / "trained.log"

    done = _life(model, redis_url, run_id, tmp_path / "run", "-1", "half", "3", "1", env={"TRAINED_LOG": str(log)})
    assert done.returncode == 0, done.stderr[-3000:]

    trained = dict(line.split() for line in log.read_text().splitlines())
    assert trained == {"batch-0": digest(batches[0]), "batch-2": digest(batches[2])}  # exactly what was published
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [(w.version, w.batch_id) for w in events] == [(0, ""), (1, "batch-0"), (2, "batch-1"), (3, "batch-2")]
    assert events[2].metrics["learner/batches_skipped"] == 1.0  # batch-1: its version, unchanged weights
    (letter,) = [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]
    assert f"batch-1 (20 samples) {BATCH_SKIPPED}: batch-1: payloads missing in Redis (1 of the 20" in letter.error
    assert f"first: {lost} in {names.batched_samples('batch-1', batches[1].samples[3].trajectory.group_id)}" in (
        letter.error
    )
    assert decode(letter.payload, BatchManifest) == second  # the coordinator counts its groups dropped from it
    assert client.xpending(names.batches, "learner")["pending"] == 0
    assert client.keys(names.batched_samples("*", "*")) == []  # acknowledged: every batch's payloads deleted


def publish_split(
    client: redis.Redis,  # type: ignore[type-arg]
    names: StreamNames,
    batch: TrainingBatch,
    lose_part: int | None = None,
) -> BatchManifest:
    """Publish ``batch`` as the coordinator publishes a large one: its refs in three parts or more (strings under the
    batch), the entry a header naming them; part ``lose_part`` deleted (Redis lost it)."""
    keys, sizes = [], []
    for s in batch.samples:
        key, payload = names.batched_samples(batch.id, s.trajectory.group_id), encode(s)
        client.hset(key, s.trajectory.id, payload)
        keys.append(key)
        sizes.append(len(payload))
    whole = manifest_of(batch, keys, sizes)
    refs = whole.samples
    runs = split_refs(refs, sum(len(msgspec.msgpack.encode(r)) for r in refs) // 3 + 1)
    assert len(runs) >= 3
    parts = [encode(ManifestPart(batch_id=batch.id, number=n, samples=run)) for n, run in enumerate(runs)]
    part_keys = [names.manifest_part(batch.id, "a1", n) for n in range(len(parts))]
    for n, (key, part) in enumerate(zip(part_keys, parts, strict=True)):
        if n != lose_part:
            client.set(key, part)
    header = msgspec.structs.replace(whole, samples=[], parts=part_keys, part_bytes=[len(p) for p in parts])
    client.xadd(names.batches, {"d": encode(header)})
    return header


def test_split_manifests_are_trained_whole_a_lost_part_skips_its_batch_never_short(
    model: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    batches = [training_batch(i) for i in range(3)]
    publish_split(client, names, batches[0])
    client.xadd(names.batches, client.xrange(names.batches)[0][1])  # a copy of batch 0's entry: a copy, not trained
    second = publish_split(client, names, batches[1], lose_part=1)
    publish_split(client, names, batches[2])
    log = tmp_path / "trained.log"

    done = _life(model, redis_url, run_id, tmp_path / "run", "-1", "half", "3", "1", env={"TRAINED_LOG": str(log)})
    assert done.returncode == 0, done.stderr[-3000:]

    trained = dict(line.split() for line in log.read_text().splitlines())
    assert trained == {"batch-0": digest(batches[0]), "batch-2": digest(batches[2])}  # whole, in order
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [(w.version, w.batch_id) for w in events] == [(0, ""), (1, "batch-0"), (2, "batch-1"), (3, "batch-2")]
    (letter,) = [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]
    lost = f"batch-1: 1 of its {len(second.parts)} manifest parts missing in Redis"
    assert f"batch-1 (20 samples) {BATCH_SKIPPED}: {lost}" in letter.error
    assert decode(letter.payload, BatchManifest) == second  # the header: the coordinator reads the parts left
    assert client.xpending(names.batches, "learner")["pending"] == 0
    left = {k.decode() for k in client.keys(names.batched_samples("*", "*"))}
    assert all(":batch-1:" in k and ":manifest:" not in k for k in left)  # only payloads of the batch the loss hit


def test_the_next_batch_is_read_while_the_current_one_trains(
    model: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    batches = [training_batch(i) for i in range(3)]
    for batch in batches:
        publish_split(client, names, batch)
    log, timeline = tmp_path / "trained.log", tmp_path / "timeline.log"
    env = {"TRAINED_LOG": str(log), "TIMELINE_LOG": str(timeline), "STEP_SLEEP_S": "1.0"}

    done = _life(model, redis_url, run_id, tmp_path / "run", "-1", "half", "3", "1", env=env)
    assert done.returncode == 0, done.stderr[-3000:]

    trained = dict(line.split() for line in log.read_text().splitlines())
    assert trained == {b.id: digest(b) for b in batches}  # exactly what was published, each once, in order
    at = {(event, batch): float(t) for event, batch, t in (line.split() for line in timeline.read_text().splitlines())}
    for k in (1, 2):  # batch k's payloads were read while batch k-1 trained, not after
        # (the prefetch may start as batch k-1's handler begins, a hair before its step: only the end bounds it)
        assert at[("fetch", f"batch-{k - 1}")] < at[("fetch", f"batch-{k}")] < at[("stepped", f"batch-{k - 1}")]
        assert at[("stepped", f"batch-{k - 1}")] < at[("step", f"batch-{k}")]
    assert client.xpending(names.batches, "learner")["pending"] == 0
    assert client.keys(names.batched_samples("*", "*")) == []  # acknowledged: payloads and parts deleted


def test_a_joined_manifest_is_read_whole_from_two_lanes_on_two_redis_servers_and_deleted_in_both(
    model: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    """Lanes: the joined manifest (split, its parts in the home) names payloads of lane 0 (on the home's Redis) and
    lane 1 (on a second redis-server); the learner trains each batch whole and its ack deletes them in both."""
    other = RedisServer(tmp_path / "lane1", appendonly=False).start()
    try:
        home = redis.Redis.from_url(redis_url)
        lane1 = redis.Redis.from_url(other.url)
        names, lanes = StreamNames(run_id), [lane_names(run_id, 0), lane_names(run_id, 1)]
        batches = [training_batch(i) for i in range(2)]
        for batch in batches:
            keys, sizes = [], []
            for s in batch.samples:  # the groups dealt to the lanes in turn
                lane = sum(map(ord, s.trajectory.group_id)) % 2
                key, payload = lanes[lane].batched_samples(batch.id, s.trajectory.group_id), encode(s)
                (home if lane == 0 else lane1).hset(key, s.trajectory.id, payload)
                keys.append(key)
                sizes.append(len(payload))
            assert {k.split("}")[0] for k in keys} == {f"streamrl:{{{run_id}/lane0", f"streamrl:{{{run_id}/lane1"}
            whole = manifest_of(batch, keys, sizes)
            runs = split_refs(whole.samples, sum(len(msgspec.msgpack.encode(r)) for r in whole.samples) // 2 + 1)
            parts = [names.manifest_part(batch.id, "j", n) for n in range(len(runs))]
            for n, (key, run) in enumerate(zip(parts, runs, strict=True)):
                home.set(key, encode(ManifestPart(batch_id=batch.id, number=n, samples=run)))
            sizes = [home.strlen(k) for k in parts]
            header = msgspec.structs.replace(whole, samples=[], parts=parts, part_bytes=sizes)
            home.xadd(names.batches, {"d": encode(header)})
        log = tmp_path / "trained.log"
        env = {"TRAINED_LOG": str(log), "LANE_URLS": f"{redis_url},{other.url}"}

        done = _life(model, redis_url, run_id, tmp_path / "run", "-1", "half", "2", "1", env=env)
        assert done.returncode == 0, done.stderr[-3000:]

        trained = dict(line.split() for line in log.read_text().splitlines())
        assert trained == {b.id: digest(b) for b in batches}  # each whole, from both lanes
        assert home.xlen(names.dead) == 0
        assert home.xpending(names.batches, "learner")["pending"] == 0
        for client, lane in ((home, lanes[0]), (lane1, lanes[1])):  # acknowledged: deleted in both lanes
            assert client.keys(lane.batched_samples("*", "*")) == []
        assert home.keys(names.batched_samples("*", "*")) == []  # and the parts in the home
    finally:
        other.stop()
