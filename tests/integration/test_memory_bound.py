"""The Redis memory bound against a real redis-server: a run at its in-flight maximum fits under it.

Each test fills a fresh redis-server with what a run of the given shape holds at its worst (per the
terms of :mod:`streamrl.ops.memory_budget`): prompt items, trajectories and scored entries pending
in their consumer groups and consumed ones not yet trimmed, group buffers, untrained and retained
batches (each a manifest on ``batches`` and its samples' ``batched:`` hashes; a consumed one's
payloads are gone), evaluation rounds, a ``weights`` entry per version, dead letters, operation keys, heartbeats
and leases - messages built and encoded as the services build them. ``used_memory`` above the empty
server's must stay below the bound (less its fixed base and its transient term: the buffers of a
command being written or read, which a fill cannot hold still) and above half of it: the bound holds
and is not absurdly loose.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import redis as syncredis

from streamrl.common.batch_payloads import fetch_samples, manifest_of
from streamrl.common.bus import PAYLOAD_FIELD, connect
from streamrl.common.codec import decode, encode
from streamrl.common.messages import (
    BatchManifest,
    DeadLetter,
    Heartbeat,
    PromptWorkItem,
    SamplingParams,
    ScoredRecord,
    ScoredTrajectory,
    Tensor,
    TrainingBatch,
    Trajectory,
    WeightsPublished,
)
from streamrl.common.payloads import record_of
from streamrl.common.streams import StreamNames
from streamrl.ops.memory_budget import MIB, RunShape, memory_bound
from streamrl.ops.redis_server import RedisServer

TRACEPARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


def _sample(shape: RunShape, rng: np.random.Generator, gid: str, i: int, response: int) -> ScoredTrajectory:
    """A scored trajectory as the services build one: the longest the shape allows, random tokens."""
    prompt = shape.max_model_len - response
    text = int(shape.text_bytes_per_token)
    traj = Trajectory(
        id=f"{gid}-{i}-{os.urandom(8).hex()}",
        group_id=gid,
        group_index=i,
        group_size=shape.group_size,
        prompt_ids=Tensor.from_numpy(rng.integers(0, 150_000, prompt, dtype=np.int32)),
        response_ids=Tensor.from_numpy(rng.integers(0, 150_000, response, dtype=np.int32)),
        logprobs=Tensor.from_numpy(rng.standard_normal(response, dtype=np.float32)),
        loss_mask=Tensor.from_numpy(np.ones(response, dtype=np.uint8)),
        prompt_text="p" * (text * prompt),
        response_text="r" * (text * response),
        finish_reason="length",
        sampling=SamplingParams(max_new_tokens=response, n=shape.group_size),
        policy_version_start=3,
        policy_version_end=3,
        label="42",
        metadata={"row": "m" * (shape.row_bytes - 64)},
        timings={"queue_s": 0.1, "generate_s": 1.2, "weights_wait_s": 0.0},
        traceparent=TRACEPARENT,
    )
    return ScoredTrajectory(
        trajectory=traj,
        reward=1.0,
        score=1.0,
        extra={"format": 1.0, "correct": 1.0},
        scorer="function:task",
        reward_latency_ms=3.2,
        traceparent=TRACEPARENT,
    )


def _record(names: StreamNames, s: ScoredTrajectory) -> ScoredRecord:
    """What the pipeline keeps of ``s`` besides its payload: its scored record."""
    key = names.payload(s.trajectory.id, "a" * 12)
    return ScoredRecord(
        trajectory=record_of(s.trajectory, key, len(encode(s.trajectory))),
        reward=s.reward,
        score=s.score,
        extra=s.extra,
        scorer=s.scorer,
        reward_latency_ms=s.reward_latency_ms,
        traceparent=s.traceparent,
    )


def _prompt(shape: RunShape, rng: np.random.Generator, gid: str, response: int) -> PromptWorkItem:
    prompt = shape.max_model_len - response
    return PromptWorkItem(
        id=gid,
        prompt_ids=Tensor.from_numpy(rng.integers(0, 150_000, prompt, dtype=np.int32)),
        prompt_text="p" * int(shape.text_bytes_per_token * prompt),
        label="42",
        metadata={"row": "m" * (shape.row_bytes - 64)},
        sampling=SamplingParams(max_new_tokens=response, n=1),
        policy_version=3,
        issued_at=time.time(),
        traceparent=TRACEPARENT,
    )


class Filler:
    """Writes a run's streams and keys as the services do, with consumer groups as they have them."""

    def __init__(self, client: syncredis.Redis, names: StreamNames) -> None:
        self.client, self.names = client, names
        for stream, group in (
            (names.prompts, "rollout"),
            (names.trajectories, "reward"),
            (names.scored, "coordinator"),
            (names.batches, "learner"),
        ):
            client.xgroup_create(stream, group, id="0", mkstream=True)

    def add(self, stream: str, group: str, payloads: list[bytes], consumed: bool) -> None:
        """Entries read by a consumer of ``group``: acknowledged if ``consumed`` (not yet trimmed), else pending."""
        pipe = self.client.pipeline(transaction=False)
        for payload in payloads:
            pipe.xadd(stream, {PAYLOAD_FIELD: payload})
        ids = pipe.execute()
        if group:
            self.client.xreadgroup(group, "c-1", {stream: ">"}, count=len(ids))
            if consumed:
                self.client.xack(stream, group, *ids)


def fill_run(client: syncredis.Redis, shape: RunShape, run_id: str) -> bytes:
    """Fill Redis with what a run of ``shape`` holds at its in-flight maximum, all but the newest batch
    waiting for a checkpoint: that one is returned (encoded), for the caller to write as the coordinator
    does (its transient buffers are part of the bound)."""
    names = StreamNames(run_id)
    rng = np.random.default_rng(0)
    f = Filler(client, names)
    response, pps, n = min(shape.response_tokens, shape.max_model_len - 1), shape.prompts_per_step, shape.group_size

    def group(tag: str, resp: int = response) -> tuple[PromptWorkItem, list[ScoredTrajectory]]:
        gid = f"{tag}-{os.urandom(6).hex()}"
        return _prompt(shape, rng, gid, resp), [_sample(shape, rng, gid, i, resp) for i in range(n)]

    def batch(index: int, payloads: bool = True) -> bytes:
        """A batch's manifest (encoded), its samples' payloads in their ``batched:`` hashes when ``payloads``
        (an untrained batch, or one trained but not yet covered by a checkpoint)."""
        batch_id, groups = f"batch-{index}", [group("b")[1] for _ in range(pps)]
        samples = [s for members in groups for s in members]
        keys, sizes = [], []
        for s in samples:
            key, payload = names.batched_payload(batch_id, s.trajectory.id), encode(s.trajectory)
            if payloads:
                client.set(key, payload)
            keys.append(key)
            sizes.append(len(payload))
        whole = TrainingBatch(
            id=batch_id,
            index=index,
            samples=samples,
            policy_version=index,
            staleness=[1] * len(samples),
            created_at=time.time(),
            traceparent=TRACEPARENT,
        )
        manifest = manifest_of(whole, keys, sizes)
        refs = [
            msgspec.structs.replace(ref, field="", scored=_record(names, s))
            for ref, s in zip(manifest.samples, samples, strict=True)
        ]
        return encode(msgspec.structs.replace(manifest, samples=refs))

    def payloads_of(samples: list[ScoredTrajectory]) -> None:
        """Each sample's payload, as the rollout worker stores it."""
        for s in samples:
            client.set(names.payload(s.trajectory.id, "a" * 12), encode(s.trajectory))

    # in flight: H batches' worth of groups - their prompt items pending at the rollout; the samples of
    # the oldest batch in a batch entry, of the next in group buffers, of the rest pending as scored entries
    horizon = [group("inflight") for _ in range(shape.horizon_batches * pps)]
    f.add(names.prompts, "rollout", [encode(p) for p, _ in horizon], consumed=False)
    f.add(names.batches, "learner", [batch(1000)], consumed=False)
    for _, samples in horizon[pps : 2 * pps]:
        payloads_of(samples)
        client.hset(
            names.group_buffer(samples[0].trajectory.group_id),
            mapping={s.trajectory.id: encode(_record(names, s)) for s in samples},
        )
    for _, ss in horizon[2 * pps :]:
        payloads_of(ss)
    f.add(
        names.scored,
        "coordinator",
        [encode(_record(names, s)) for _, ss in horizon[2 * pps :] for s in ss],
        consumed=False,
    )
    # trained batches waiting for a checkpoint: pending in the learner's group
    f.add(
        names.batches,
        "learner",
        [batch(i) for i in range(min(shape.checkpoint_every, shape.total_steps) - 1)],
        consumed=False,
    )
    # consumed, not yet trimmed: L batches' worth of every stream
    lagging = [group("lag") for _ in range(shape.lag_batches * pps)]
    f.add(names.prompts, "rollout", [encode(p) for p, _ in lagging], consumed=True)
    f.add(
        names.trajectories,
        "reward",
        [encode(_record(names, s).trajectory) for _, ss in lagging for s in ss],
        consumed=True,
    )
    f.add(names.scored, "coordinator", [encode(_record(names, s)) for _, ss in lagging for s in ss], consumed=True)
    f.add(names.batches, "learner", [batch(2000 + i, False) for i in range(shape.lag_batches)], consumed=True)
    # two open evaluation rounds: one-sample prompts at every stage, answers in the round's buffer
    eval_response = min(shape.eval_response_tokens, shape.max_model_len - 1)
    for version in range(2 if shape.eval_prompts else 0):
        rows = [
            (
                _prompt(shape, rng, f"eval-{version}-{k}", eval_response),
                _sample(shape, rng, f"eval-{version}-{k}", 0, eval_response),
            )
            for k in range(shape.eval_prompts)
        ]
        f.add(names.prompts, "rollout", [encode(p) for p, _ in rows], consumed=False)
        payloads_of([s for _, s in rows])  # pending at the reward tier: their payloads are stored
        f.add(names.trajectories, "reward", [encode(_record(names, s).trajectory) for _, s in rows], consumed=False)
        f.add(names.scored, "coordinator", [encode(_record(names, s)) for _, s in rows], consumed=False)
        client.hset(
            names.group_buffer(f"eval-v{version}"),
            mapping={s.trajectory.id: encode(_record(names, s)) for _, s in rows},
        )
    # the whole run: a weights event per version (signed, with the step's metrics), per-version hashes
    metrics = {f"train/metric_{k:02d}": 0.5 for k in range(40)}
    weights = [
        encode(
            WeightsPublished(
                version=v,
                step=v,
                batch_id=f"batch-{v}",
                checksum="c" * 64,
                num_bytes=10**9,
                num_buckets=16,
                endpoint="tcp://10.0.0.1:5555",
                metrics=metrics,
                published_at=time.time(),
                signature="s" * 64,
            )
        )
        for v in range(shape.total_steps + 1)
    ]
    f.add(names.weights, "", weights, consumed=False)
    client.hset(
        names.state("version_seen_at"), mapping={str(v): f"{time.time():.3f}" for v in range(shape.total_steps)}
    )
    client.hset(names.state("eval_rounds"), mapping={str(v): "0.512500" for v in range(shape.total_steps)})
    # run state: the learner's last 1,024 batch fingerprints, the coordinator's per-group bookkeeping
    client.hset(names.state("learner_batches"), mapping={str(i): os.urandom(32).hex() for i in range(1024)})
    inflight = [p.id for p, _ in horizon]
    client.sadd(names.state("inflight"), *inflight)
    client.hset(names.state("inflight_info"), mapping={g: f"3@{time.time():.3f}" for g in inflight})
    client.rpush(names.state("ready"), *inflight)
    # dead letters: sample-sized ones and skipped batches
    letters = [
        encode(
            DeadLetter(
                stream=names.scored,
                entry_id="1-0",
                group="coordinator",
                consumer="c-1",
                error="ValueError: " + "e" * 200,
                deliveries=3,
                payload=encode(_record(names, group("dead")[1][0])),
                ts=time.time(),
            )
        )
        for _ in range(shape.dead_letters)
    ]
    letters += [
        encode(
            DeadLetter(
                stream=names.batches,
                entry_id="1-0",
                group="learner",
                consumer="learner",
                error="skipped",
                deliveries=1,
                payload=batch(3000 + k, False),
                ts=time.time(),
            )
        )
        for k in range(shape.dead_batches)
    ]
    f.add(names.dead, "", letters, consumed=False)
    # operation keys at their rate for their lifetime; heartbeats, instances, leases, served versions
    once = int((2 * shape.prompts_per_step + 16) / shape.min_step_s * 2 * shape.outage_s)
    pipe = client.pipeline(transaction=False)
    for _ in range(once):
        pipe.set(
            names.state("x").replace("state:x", f"once:{os.urandom(16).hex()}"),
            b"\x93\x01\x01\xa2OK",
            px=int(2 * shape.outage_s * 1000),
        )
    for k in range(shape.instances):
        beat = Heartbeat(service="rollout", instance=f"rollout-{k}", pid=1000 + k, ts=time.time(), processed=10**6)
        pipe.set(names.heartbeat("rollout", f"rollout-{k}"), encode(beat), px=4000)
        pipe.sadd(names.instances, f"rollout:rollout-{k}")
        pipe.set(names.lease("instance", "rollout", f"rollout-{k}"), os.urandom(16).hex(), px=10_000)
        pipe.hset(names.served_versions, f"rollout-{k}", 3)
    pipe.execute()
    return batch(999)


async def fetched_bytes(port: int, manifest: BatchManifest) -> int:
    """The bytes of ``manifest``'s payloads, read as the learner reads them (replies of at most 8 MiB)."""
    client = connect(f"redis://127.0.0.1:{port}/0")
    try:
        samples = await fetch_samples(client, manifest, max_reply_bytes=8 * MIB)
    finally:
        await client.aclose()
    return sum(len(encode(s.trajectory)) for s in samples)


def used_memory(client: syncredis.Redis) -> int:
    client.execute_command("MEMORY", "PURGE")  # jemalloc's dirty pages are not data
    return int(client.info("memory")["used_memory"])


SHAPES = {
    # the demo's regime: tiny entries sharing listpack nodes, fast steps (every stream lags several steps)
    "small-entries": RunShape(
        prompts_per_step=32,
        group_size=8,
        max_staleness=1,
        prefetch_steps=1,
        total_steps=600,
        checkpoint_every=10,
        max_model_len=32,
        response_tokens=6,
        eval_prompts=500,
        eval_response_tokens=6,
        read_count=256,
        min_step_s=0.5,
        row_bytes=128,
        dead_letters=64,
    ),
    # long sequences: every entry its own node, rounded up to a jemalloc size class
    "long-sequences": RunShape(
        prompts_per_step=4,
        group_size=4,
        max_staleness=1,
        prefetch_steps=1,
        total_steps=200,
        checkpoint_every=4,
        max_model_len=4096,
        response_tokens=2048,
        eval_prompts=16,
        eval_response_tokens=512,
        min_step_s=2.0,
        retain_consumed_s=1.0,
        dead_letters=16,
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_run_at_its_maximum_fits_the_bound(tmp_path: Path, name: str) -> None:
    shape = SHAPES[name]
    server = RedisServer(tmp_path / "redis").start()  # with AOF, as streamrl up runs it
    names = StreamNames("bound")
    try:
        with syncredis.Redis(port=server.port) as client:
            empty = used_memory(client)
        with syncredis.Redis(port=server.port) as client:
            last_batch = fill_run(client, shape, "bound")
        with syncredis.Redis(port=server.port) as client, syncredis.Redis(port=server.port) as learner:
            client.config_resetstat()  # the peak from here on: the last batch written through a script, then read
            client.eval("return redis.call('XADD', KEYS[1], '*', 'd', ARGV[1])", 1, names.batches, last_batch)
            ((_, ((_, fields),)),) = learner.xreadgroup("learner", "c-1", {names.batches: ">"}, count=1)
            manifest = decode(fields[b"d"], BatchManifest)  # the learner reads its payloads
            fetched = asyncio.run(fetched_bytes(server.port, manifest))
            assert fetched == sum(r.num_bytes for r in manifest.samples)
            peak = int(client.info("memory")["used_memory_peak"]) - empty
        # measured from a new connection: the writer's query buffer (counted as transient) is gone
        with syncredis.Redis(port=server.port) as client:
            held = used_memory(client) - empty
    finally:
        server.stop()
    bound = memory_bound(shape)
    fillable = bound.total - bound.terms["base"] - bound.terms["transient"]
    print(
        f"{name}: held {held / MIB:.2f} MiB, bound {fillable / MIB:.2f} MiB (ratio {fillable / held:.2f}); peak "
        f"{peak / MIB:.2f} MiB, bound with transients {(fillable + bound.terms['transient']) / MIB:.2f}; "
        f"{bound.describe()}"
    )
    assert held <= fillable, f"{name}: Redis holds {held} bytes, over the bound's {fillable}"
    assert fillable <= 2 * held, f"{name}: the bound ({fillable} bytes) is over twice what Redis holds ({held})"
    assert peak <= fillable + bound.terms["transient"], f"{name}: peak {peak} bytes while a batch was written"
