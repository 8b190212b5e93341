"""The Redis ACL users (streamrl.ops.redis_acl) on a real redis-server started with their file.

Each service's user does its job - a real ConsumerLoop on its input (trimming it by consumption,
taking over a dead peer's entries), its outputs and dead letters through the shared commit script,
the coordinator's and the learner's fenced, run-once writes (``once`` keys: transactions, the
coordinator's scripts, the learner's ledger), its heartbeat and health check, its follower reads -
without one refused command (the server's ACL LOG stays empty), and a whole smoke run completes with
every service logged in as itself. Each user is refused what is not its job: writing another service's
stream (directly or through the commit script), another run's keys, anything for the observer,
server administration for all; a wrong password and the ``default`` user are refused. With an
``allkeys allcommands`` file every refusal test fails (each refused command is run by an admin
user too, to show it is a valid command).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.retry import Retry

from streamrl.common.batch_payloads import fetch_batch, manifest_of
from streamrl.common.bus import Bus, Output, connect
from streamrl.common.codec import decode, encode
from streamrl.common.config import ConsumerConfig
from streamrl.common.consumer import ConsumerLoop, encode_payload
from streamrl.common.follower import StreamFollower
from streamrl.common.health import check, heartbeat_forever, read_heartbeats
from streamrl.common.lease import Lease, holder_token
from streamrl.common.messages import (
    BatchManifest,
    DeadLetter,
    Heartbeat,
    Message,
    PromptWorkItem,
    ScoredTrajectory,
    Tensor,
    TrainingBatch,
    Trajectory,
    WeightsPublished,
)
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.prom import StreamGroupsCollector
from streamrl.common.tx import Fence, once_key
from streamrl.coordinator.batches import DEAD_BATCH_LUA, RESEND_LUA
from streamrl.coordinator.scripts import FencedScript
from streamrl.learner.rl.ledger import LearnerLedger
from streamrl.ops.redis_acl import SERVICES, USERS, acl_file, new_passwords
from streamrl.ops.redis_server import find_redis_server, free_port

RUN = "acl"
N = StreamNames(RUN)
ADMIN_PASSWORD = "admin-password-for-the-test-only"
M = TypeVar("M", bound=Message)
FAST = ConsumerConfig(block_ms=50, claim_interval_s=0.1, heartbeat_interval_s=0.2, retry_delay_s=0.0)


@dataclass
class AclRedis:
    port: int
    passwords: dict[str, str]
    names: StreamNames

    def url(self, user: str, password: str | None = None) -> str:
        secret = password if password is not None else self.passwords.get(user, ADMIN_PASSWORD)
        return f"redis://{user}:{secret}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:  # type: ignore[type-arg]
        return redis.Redis.from_url(self.url(user), socket_timeout=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    """redis-server with the run's ACL file, plus an ``admin`` user (this test's only) to set up and look."""
    d = tmp_path_factory.mktemp("acl-redis")
    passwords = new_passwords()
    admin = f"user admin on #{hashlib.sha256(ADMIN_PASSWORD.encode()).hexdigest()} ~* &* +@all\n"
    (d / "users.acl").write_text(acl_file(RUN, passwords) + admin)
    port = free_port()
    proc = subprocess.Popen(
        [
            find_redis_server(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(d),
            "--save",
            "",
            "--appendonly",
            "no",
            "--aclfile",
            str(d / "users.acl"),
            "--logfile",
            "redis.log",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    found = AclRedis(port, passwords, StreamNames(RUN))
    try:
        admin = found.client("admin")
        deadline = time.monotonic() + 10
        while not _pings(admin):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "redis-server did not answer"
            time.sleep(0.05)
        yield found
    finally:
        proc.terminate()
        proc.wait(10)


def _pings(client: redis.Redis) -> bool:  # type: ignore[type-arg]
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture
def acl(server: AclRedis) -> Iterator[AclRedis]:
    """The server, empty and with an empty ACL LOG; after the test, the log must hold no refusal
    the test did not expect (tests that expect refusals clear it themselves)."""
    admin = server.client("admin")
    admin.flushall()
    admin.acl_log_reset()
    yield server


def refusals(acl: AclRedis) -> list[str]:
    """What the server refused since the last reset, one line each (user, command or key)."""
    entries = acl.client("admin").acl_log(count=100)
    # redis-py names its library with CLIENT SETINFO and ignores a refusal (not granted: see CONNECTION)
    return [f"{e['username']}: {e['reason']} {e['object']}" for e in entries if e["object"] != "client|setinfo"]


def trajectory(i: int) -> Trajectory:
    n = 4
    return Trajectory(
        id=f"g{i}/0",
        group_id=f"g{i}",
        group_index=0,
        group_size=1,
        prompt_ids=Tensor.from_list([1, 2], "int32"),
        response_ids=Tensor.from_numpy(np.arange(n, dtype=np.int32)),
        logprobs=Tensor.from_numpy(np.full(n, -0.5, dtype=np.float32)),
        loss_mask=Tensor.from_numpy(np.ones(n, dtype=np.uint8)),
    )


def scored(i: int) -> ScoredTrajectory:
    return ScoredTrajectory(trajectory=trajectory(i), reward=1.0)


def weights_event(version: int) -> WeightsPublished:
    return WeightsPublished(
        version=version,
        step=version,
        batch_id=f"b{version}",
        checksum="c",
        num_bytes=1,
        num_buckets=1,
        endpoint="tcp://learner:29600",
    )


async def consume(
    acl: AclRedis,
    user: str,
    stream: str,
    message_type: type[M],
    outputs: Callable[[M], list[Output]],
    until: Callable[[], bool] | None = None,
    **kwargs: Any,
) -> ConsumerLoop[M]:
    """Run ``user``'s consumer loop over ``stream`` as the service does, with its heartbeat beating,
    to the stream's end (or, given ``until``, until it holds); then its health check and the clean-up
    of its heartbeat."""
    client = connect(acl.url(user), outage_s=2)
    bus = Bus(client, once_scope=user)  # as lifecycle.bus_of builds it
    instance = f"{user}-0"

    async def handle(msg: M) -> list[Output]:
        return outputs(msg)

    loop = ConsumerLoop(
        bus,
        acl.names,
        stream=stream,
        group=user,
        consumer=instance,
        handler=handle,
        message_type=message_type,
        config=FAST,
        **kwargs,
    )
    beat = asyncio.create_task(heartbeat_forever(client, acl.names, user, instance, 0.2, lambda: {}))
    if until is None:
        await loop.run(asyncio.Event(), burst=True)
    else:
        stop = asyncio.Event()
        running = asyncio.create_task(loop.run(stop))
        for _ in range(200):
            if await asyncio.to_thread(until):
                break
            await asyncio.sleep(0.05)
        stop.set()
        await running
    assert await asyncio.to_thread(check, acl.url(user), acl.names, user, instance) == 0
    beat.cancel()
    await client.delete(acl.names.heartbeat(user, instance))
    await client.srem(acl.names.instances, f"{user}:{instance}")
    await client.aclose()
    return loop


def feed(acl: AclRedis, stream: str, *messages) -> None:  # type: ignore[no-untyped-def]
    """The entries ``stream`` gets from upstream (written by the admin), then one undecodable entry."""
    admin = acl.client("admin")
    for message in messages:
        admin.xadd(stream, encode_payload(message))
    admin.xadd(stream, {b"d": b"\xc1 not msgpack"})


def dead_letters(acl: AclRedis) -> list[DeadLetter]:
    return [decode(f[b"d"], DeadLetter) for _, f in acl.client("admin").xrange(acl.names.dead)]


def test_rollout_user_does_the_rollout_job(acl: AclRedis) -> None:
    names = acl.names
    feed(acl, names.prompts, PromptWorkItem(id="g0", prompt_ids=Tensor.from_list([1, 2], "int32")))
    acl.client("admin").xadd(names.weights, encode_payload(weights_event(1)))

    async def job() -> None:
        await consume(
            acl,
            "rollout",
            names.prompts,
            PromptWorkItem,
            lambda m: [Output(stream=names.trajectories, message=trajectory(0))],
        )
        client = connect(acl.url("rollout"), outage_s=2)
        seen: list[WeightsPublished] = []

        async def on_weights(entries, last_id):  # type: ignore[no-untyped-def]
            seen.extend(e for _, e in entries)
            stop.set()
            return last_id

        stop = asyncio.Event()
        follower = StreamFollower(client, names.weights, lambda f: decode(f[b"d"], WeightsPublished), on_weights)
        await asyncio.wait_for(follower.run("0-0", stop), 10)
        assert [w.version for w in seen] == [1]
        assert len(await client.xrevrange(names.weights, count=16)) == 1
        await client.hset(names.served_versions, "rollout-0", 1)
        await client.hdel(names.served_versions, "rollout-0")
        await client.aclose()

    asyncio.run(job())
    admin = acl.client("admin")
    assert admin.xlen(names.trajectories) == 1
    assert [d.stream for d in dead_letters(acl)] == [names.prompts]
    assert admin.xpending(names.prompts, "rollout")["pending"] == 0
    # its Prometheus endpoint reads the lag of the stream it consumes
    collector = StreamGroupsCollector(acl.url("rollout"), {"prompts": names.prompts})
    _, pending = collector.collect()
    collector.close()
    assert [(s.labels, s.value) for s in pending.samples] == [({"stream": "prompts", "group": "rollout"}, 0.0)]
    assert refusals(acl) == []


def test_each_user_does_its_part_of_a_payloads_life(acl: AclRedis) -> None:
    """Payload once, references after: the rollout user SETs and PERSISTs it (its commit's EXISTS), the reward
    user reads it (whole, or its head: GETRANGE), the coordinator renames it under a batch (or deletes it), the learner reads the batched one
    and deletes it or gives it a time to live; nothing else."""
    names = acl.names
    key, batched = names.payload("g0/0", "a1"), names.batched_payload("batch-0", "g0/0")
    rollout, reward, coordinator, learner = (acl.client(u) for u in ("rollout", "reward", "coordinator", "learner"))
    assert rollout.set(key, b"payload", nx=True, px=60_000)
    assert rollout.persist(key) and rollout.exists(key) == 1
    assert reward.get(key) == b"payload" and reward.getrange(key, 0, 2) == b"pay"
    assert coordinator.rename(key, batched)
    assert learner.get(batched) == b"payload"
    assert learner.expire(batched, 60) and learner.unlink(batched) == 1
    rollout.set(key, b"orphan", nx=True, px=60_000)
    assert coordinator.unlink(key) == 1 and coordinator.delete(key) == 0
    refused = (
        ("reward", ("SET", key, "x")),
        ("reward", ("SETRANGE", key, 0, "x")),
        ("learner", ("GET", key)),
        ("rollout", ("GET", key)),
        ("rollout", ("GETRANGE", key, 0, 1)),
    )
    for user, command in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            acl.client(user).execute_command(*command)
    acl.client("admin").acl_log_reset()


def test_reward_user_does_the_reward_job(acl: AclRedis) -> None:
    """Including taking over what a dead instance (no heartbeat) left pending, a redelivery."""
    names = acl.names
    admin = acl.client("admin")
    admin.xgroup_create(names.trajectories, "reward", id="0", mkstream=True)
    feed(acl, names.trajectories, trajectory(0), trajectory(1))
    admin.xreadgroup("reward", "reward-9", {names.trajectories: ">"}, count=1)
    admin.sadd(names.instances, "reward:reward-9")
    time.sleep(2 * FAST.heartbeat_interval_s)  # idle long enough to be taken over

    def done() -> bool:
        return admin.xlen(names.scored) == 2 and admin.xpending(names.trajectories, "reward")["pending"] == 0

    loop = asyncio.run(
        consume(
            acl,
            "reward",
            names.trajectories,
            Trajectory,
            lambda t: [Output(stream=names.scored, message=ScoredTrajectory(trajectory=t, reward=1.0))],
            until=done,
        )
    )
    assert loop.stats.reclaimed == 1
    assert admin.xlen(names.scored) == 2 and len(dead_letters(acl)) == 1
    assert admin.xpending(names.trajectories, "reward")["pending"] == 0
    assert refusals(acl) == []


def test_a_dead_peer_that_shares_its_name_with_another_service_is_forgotten(acl: AclRedis) -> None:
    """Instance names are per service: ``rollout:w-9`` and ``reward:w-9`` may both exist. The dead-peer
    check script declares the heartbeat key of every instance of the dead consumer's name, the other
    service's too (it only EXISTS it): the script is allowed to name it, and the entry is taken over."""
    names = acl.names
    admin = acl.client("admin")
    admin.xgroup_create(names.trajectories, "reward", id="0", mkstream=True)
    admin.xadd(names.trajectories, encode_payload(trajectory(0)))
    admin.xreadgroup("reward", "w-9", {names.trajectories: ">"}, count=1)
    admin.sadd(names.instances, "reward:w-9", "rollout:w-9")

    def done() -> bool:
        return admin.xlen(names.scored) == 1 and not admin.xinfo_consumers(names.trajectories, "reward")[:-1]

    def score(t: Trajectory) -> list[Output]:
        return [Output(stream=names.scored, message=ScoredTrajectory(trajectory=t, reward=1.0))]

    asyncio.run(consume(acl, "reward", names.trajectories, Trajectory, score, until=done))
    assert [c["name"] for c in admin.xinfo_consumers(names.trajectories, "reward")] == [b"reward-0"]
    assert admin.smembers(names.instances) == set(), "both dead instances of that name are forgotten"
    assert refusals(acl) == []


async def fenced_bus(acl: AclRedis, service: str) -> tuple[Bus, Lease]:
    """``service``'s bus as lifecycle sets it up for a singleton: its role leased, its writes fenced by it."""
    client = connect(acl.url(service), outage_s=2)
    token = holder_token(f"{service}-0")
    lease = Lease(client, acl.names.lease("singleton", service), token, 5.0, f"the {service}")
    assert await lease.acquire(0)
    bus = Bus(client, outage_s=2, once_scope=service)  # as lifecycle.bus_of builds it
    bus.fence = Fence(lease.key, token)
    return bus, lease


def test_coordinator_user_does_the_coordinator_job(acl: AclRedis) -> None:
    """Its consumer loop on ``scored``, its tails, and its writes as the coordinator makes them: fenced
    transactions (``once`` keys, preconditions on its state) and its own fenced scripts."""
    names = acl.names
    feed(acl, names.scored, scored(0))
    acl.client("admin").xadd(names.weights, encode_payload(weights_event(1)))

    async def job() -> None:
        await consume(
            acl,
            "coordinator",
            names.scored,
            ScoredTrajectory,
            lambda s: [Output(key=names.group_buffer(s.trajectory.group_id), field=s.trajectory.id, message=s)],
        )
        bus, lease = await fenced_bus(acl, "coordinator")
        client, state = bus.redis, names.state
        for stream in (names.weights, names.dead):
            assert len(await client.xread({stream: "0-0"}, count=16)) == 1
        assert await client.xlen(names.weights) == 1
        await bus.tx().set(state("policy_version"), 1).execute()
        item = PromptWorkItem(id="p0", prompt_ids=Tensor.from_list([1], "int32"))
        issue = bus.tx().require(state("cursor"), equals=None).xadd(names.prompts, item).sadd(state("inflight"), "g1")
        issue.call("HSETNX", state("inflight_info"), "g1", "0@0").set(state("cursor"), 1)
        await issue.incrby(state("late_samples_dropped"), 0).execute()
        samples = await client.hgetall(names.group_buffer("g0"))
        batch = TrainingBatch(
            id="batch-0",
            index=0,
            samples=[decode(v, ScoredTrajectory) for v in samples.values()],
            policy_version=0,
            staleness=[0],
        )
        sizes = [len(v) for v in samples.values()]
        manifest = manifest_of(batch, [names.batched_samples("batch-0", "g0")], sizes)
        publish = (
            bus.tx()
            .require(state("batch_index"), equals=None)
            .rename(names.group_buffer("g0"), names.batched_samples("batch-0", "g0"))
        )
        publish.xadd(names.batches, manifest).set(state("batch_index"), 1).lrem(state("ready"), 1, "g0")
        await publish.execute()
        await bus.tx().call("HSET", state("progress"), "step", "1").execute()
        # its own scripts, fenced and run once: one that sends a refused batch again (XADD batches)
        resend = FencedScript(bus, RESEND_LUA, "batches.RESEND_LUA")
        keys = [state("dead_batch_ids"), state("batch_resends"), names.batches]
        assert await resend(keys, ["batch-0", 2, bus.maxlen, encode(manifest)]) == 1
        dead = FencedScript(bus, DEAD_BATCH_LUA, "batches.DEAD_BATCH_LUA")
        counters = [state("dead_batch_ids"), state("batches_dead"), state("samples_dead"), state("batch_groups_dead")]
        assert await dead([*counters, *manifest.buffers], ["batch-0", 1, 1]) == 1  # its samples deleted
        await lease.release()
        await client.aclose()

    asyncio.run(job())
    admin = acl.client("admin")
    assert admin.xlen(names.batches) == 2 and admin.xlen(names.prompts) == 1
    assert admin.get(names.state("cursor")) == b"1" and admin.get(names.state("batches_dead")) == b"1"
    assert not admin.exists(names.batched_samples("batch-0", "g0"))
    assert refusals(acl) == []


def test_learner_user_does_the_learner_job(acl: AclRedis) -> None:
    """Its consumer loop on ``batches`` (acks held back), the payloads a manifest names read, and every write of
    its ledger (the ack deleting those payloads), fenced by its lease."""
    names = acl.names
    batch = TrainingBatch(id="batch-0", index=0, samples=[scored(0)], policy_version=0, staleness=[0])
    payload = encode(batch.samples[0])
    acl.client("admin").hset(names.batched_samples("batch-0", "g0"), batch.samples[0].trajectory.id, payload)
    feed(acl, names.batches, manifest_of(batch, [names.batched_samples("batch-0", "g0")], [len(payload)]))

    async def job() -> None:
        committed: list[str] = []

        async def on_committed(entry_id: str, _: BatchManifest) -> None:
            committed.append(entry_id)

        await consume(acl, "learner", names.batches, BatchManifest, lambda b: [], ack=False, on_committed=on_committed)
        bus, lease = await fenced_bus(acl, "learner")
        ((_, fields),) = await bus.redis.xrange(names.batches, count=1)
        manifest = decode(fields[b"d"], BatchManifest)
        assert await fetch_batch(bus.redis, manifest, max_reply_bytes=2**20) == batch
        ledger = LearnerLedger(bus, names)
        assert list(await ledger.still_to_come(names.batches)) == [0]
        await ledger.claim(0, "fingerprint-0")
        await ledger.start("batch-0")
        await ledger.finish("batch-0", "RuntimeError: test")
        await ledger.note("batch-0", "RuntimeError: test")
        assert (await ledger.attempts("batch-0")).failed == 1
        assert await ledger.publish(weights_event(1), None, "1@life")
        assert (await ledger.published()) is not None and await ledger.version_mark() == "1@life"
        entry, err = committed[0], "test"
        letter = DeadLetter(names.batches, entry, "learner", "learner", err, deliveries=1, payload=b"", ts=0.0)
        assert await ledger.dead_letter_once("batch-0", letter)
        assert not await ledger.dead_letter_once("batch-0", letter)
        await ledger.ack(names.batches, committed, ["batch-0"], acked_from=0, acked_index=1, payloads=manifest.buffers)
        assert await ledger.acked_index() == 1
        await lease.release()
        await bus.redis.aclose()

    asyncio.run(job())
    admin = acl.client("admin")
    assert admin.xlen(names.weights) == 1 and len(dead_letters(acl)) == 2
    assert admin.xpending(names.batches, "learner")["pending"] == 0
    assert not admin.exists(names.batched_samples("batch-0", "g0"))
    assert refusals(acl) == []


CONSUMED = {"coordinator": N.scored, "rollout": N.prompts, "reward": N.trajectories, "learner": N.batches}
"""The stream each service consumes, as its consumer group."""


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_trims_the_stream_it_consumes(acl: AclRedis, service: str) -> None:
    """The consumer loop trims its input by consumption (XINFO GROUPS, XPENDING, TIME, XTRIM MINID ~):
    what its group handled goes, without one refused command."""
    stream = CONSUMED[service]
    admin = acl.client("admin")
    pipe = admin.pipeline(transaction=False)
    for i in range(300):  # three stream nodes of 100 entries: approximate trimming drops whole nodes
        pipe.xadd(stream, {b"d": encode(Heartbeat(service="x", instance=str(i), pid=1, ts=0.0))})
    pipe.execute()
    asyncio.run(consume(acl, service, stream, Heartbeat, lambda _: [], until=lambda: admin.xlen(stream) < 300))
    assert admin.xpending(stream, service)["pending"] == 0
    assert admin.xlen(stream) < 300, "nothing was trimmed"
    assert refusals(acl) == []


def test_observer_reads_everything_of_the_run(acl: AclRedis) -> None:
    names = acl.names
    admin = acl.client("admin")
    admin.set(names.heartbeat("rollout", "r-0"), encode(Heartbeat(service="rollout", instance="r-0", pid=1, ts=0.0)))
    admin.sadd(names.instances, "rollout:r-0", "reward:gone")  # reward:gone has no heartbeat key
    admin.xadd(
        names.batches, encode_payload(TrainingBatch(id="b", index=0, samples=[], policy_version=0, staleness=[]))
    )
    admin.xgroup_create(names.batches, "learner", id="0")
    admin.hset(names.state("progress"), mapping={"step": "3"})
    beats = read_heartbeats(acl.url("observer"), names)
    assert [b.instance for b in beats] == ["r-0"]
    observer = acl.client("observer")
    assert observer.xlen(names.batches) == 1 and len(observer.xrange(names.batches)) == 1
    assert observer.xinfo_groups(names.batches)[0]["name"] == b"learner"
    assert observer.xpending(names.batches, "learner")["pending"] == 0
    assert observer.hgetall(names.state("progress")) == {b"step": b"3"}
    assert refusals(acl) == []  # reading the live heartbeats writes nothing


@dataclass(frozen=True)
class Case:
    user: str
    command: tuple[str, ...]
    why: str
    valid: bool = True
    """An admin may run it (a real command, refused for the user only); False for server-wide harm."""


W = encode_payload(weights_event(9))[b"d"]
ONCE = once_key([N.prompts], "0123456789abcdef01234567")
ONCE_OF = {
    service: once_key([N.prompts], "0123456789abcdef01234567", service) for service in ("coordinator", "learner")
}
REFUSED = [
    Case("rollout", ("XADD", N.weights, "*", "d", W), "only the learner publishes weights"),
    Case("rollout", ("XADD", N.prompts, "*", "d", "x"), "rollout consumes prompts, it does not issue them"),
    Case("rollout", ("XADD", N.scored, "*", "d", "x"), "rewards come from the reward tier"),
    Case("rollout", ("SET", N.state("policy_version"), "99"), "run state is the coordinator's"),
    Case("rollout", ("DEL", N.prompts), "no service deletes a stream"),
    Case("rollout", ("XTRIM", N.trajectories, "MINID", "0-1"), "a producer never trims what it produced"),
    Case("learner", ("XTRIM", N.prompts, "MINID", "0-1"), "nor a stream another service consumes"),
    Case("rollout", ("XADD", "streamrl:other:trajectories", "*", "d", "x"), "another run's keys"),
    Case("rollout", ("SET", N.heartbeat("learner", "l-0"), "x"), "another service's heartbeat"),
    Case("rollout", ("SET", N.lease("instance", "reward", "r-0"), "x"), "another service's lease"),
    Case("rollout", ("SET", ONCE, "x"), "rollout runs no once-operations (its commits ack an entry)"),
    Case("reward", ("DEL", ONCE), "reward runs no once-operations (its commits ack an entry)"),
    Case("rollout", ("SET", ONCE_OF["learner"], "x"), "nor in another service's name"),
    Case(
        "coordinator",
        ("DEL", ONCE_OF["learner"]),
        "the learner's once keys are its own (deleted: a re-send runs twice)",
    ),
    Case("coordinator", ("SET", ONCE_OF["learner"], "x"), "nor pre-set (a write of the learner would never run)"),
    Case("learner", ("GET", ONCE_OF["coordinator"]), "the coordinator's once keys are its own"),
    Case("learner", ("SET", ONCE, "x"), "once keys name their service"),
    Case("coordinator", ("HSET", N.state("learner"), "acked", "99"), "the learner's ledger is the learner's"),
    Case("coordinator", ("SET", N.state("learner_version"), "9@x"), "the learner's publication mark"),
    Case("learner", ("INCR", N.state("late_samples_dropped")), "coordinator counters are the coordinator's"),
    Case("coordinator", ("XRANGE", N.batches, "-", "+"), "the coordinator writes batches, it never reads them back"),
    Case("reward", ("XADD", N.batches, "*", "d", "x"), "batches come from the coordinator"),
    Case("reward", ("XADD", N.weights, "*", "d", W), "only the learner publishes weights"),
    Case("reward", ("XRANGE", N.batches, "-", "+"), "reading the learner's input"),
    Case("reward", ("XACK", N.batches, "learner", "0-1"), "acknowledging the learner's input"),
    Case("learner", ("XADD", N.prompts, "*", "d", "x"), "prompts come from the coordinator"),
    Case("learner", ("HSET", N.group_buffer("g"), "t", "x"), "group buffers are the coordinator's"),
    Case("learner", ("HGETALL", N.group_buffer("g")), "a group still collecting is the coordinator's"),
    Case(
        "learner", ("HSET", N.batched_samples("batch-0", "g"), "t", "x"), "a batch's payloads are read, never written"
    ),
    Case("learner", ("SET", N.state("policy_version"), "99"), "the policy version is the coordinator's"),
    Case("coordinator", ("XADD", N.weights, "*", "d", W), "only the learner publishes weights"),
    Case("coordinator", ("XADD", N.trajectories, "*", "d", "x"), "trajectories come from rollout"),
    Case("coordinator", ("XADD", N.scored, "*", "d", "x"), "rewards come from the reward tier"),
    Case("observer", ("XADD", N.dead, "*", "d", "x"), "the observer writes nothing"),
    Case("observer", ("SET", N.state("policy_version"), "99"), "the observer writes nothing"),
    Case("observer", ("XGROUP", "CREATE", N.prompts, "rollout", "0", "MKSTREAM"), "the observer writes nothing"),
    Case("observer", ("EVAL", "return 1", "0"), "the observer runs no scripts"),
    Case("observer", ("KEYS", "*"), "listing every key of every run"),
    Case("coordinator", ("SCAN", "0"), "listing every key of every run"),
    Case("learner", ("RANDOMKEY",), "reading a key of any run"),
    Case("coordinator", ("SET", "streamrl:other:state:policy_version", "1"), "another run's state"),
    *(Case(user, ("FLUSHALL",), "wiping the server", valid=False) for user in USERS),
    *(Case(user, ("CONFIG", "SET", "appendonly", "no"), "server configuration", valid=False) for user in USERS),
    *(Case(user, ("ACL", "SETUSER", user, "+@all", "~*"), "granting itself more", valid=False) for user in USERS),
    *(Case(user, ("SCRIPT", "FLUSH"), "dropping every script", valid=False) for user in SERVICES),
    *(Case(user, ("PUBLISH", "ch", "x"), "pub/sub (no service uses channels)") for user in USERS),
]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: f"{c.user}-{'-'.join(c.command[:2]).lower()}")
def test_each_user_is_refused_what_is_not_its_job(acl: AclRedis, case: Case) -> None:
    with pytest.raises(NoPermissionError):
        acl.client(case.user).execute_command(*case.command)
    if case.valid:  # the same command is fine for a user allowed everything: only the ACL refused it
        acl.client("admin").execute_command(*case.command)


def test_the_commit_script_grants_nothing(acl: AclRedis) -> None:
    """Lua runs as its caller: a rollout worker's commit that writes to weights (or the weights key
    through a raw EVAL) is refused, writes nothing, and acknowledges nothing."""
    names = acl.names
    admin = acl.client("admin")
    admin.xgroup_create(names.prompts, "rollout", id="0", mkstream=True)
    entry = admin.xadd(names.prompts, {b"d": b"x"}).decode()
    admin.xreadgroup("rollout", "rollout-0", {names.prompts: ">"})

    async def forge() -> None:
        client = connect(acl.url("rollout"), outage_s=2)
        with pytest.raises(ResponseError, match=r"(?i)no permissions|can't access"):
            await Bus(client).commit(
                [Output(stream=names.weights, message=weights_event(9))],
                ack_stream=names.prompts,
                ack_group="rollout",
                ack_entry=entry,
            )
        with pytest.raises(ResponseError, match=r"(?i)no permissions|can't access"):
            await client.eval("return redis.call('XADD', ARGV[1], '*', 'd', 'x')", 0, names.weights)
        await client.aclose()

    asyncio.run(forge())
    assert admin.xlen(names.weights) == 0
    assert admin.xpending(names.prompts, "rollout")["pending"] == 1, "a refused commit acknowledges nothing"


@pytest.mark.parametrize("user", USERS)
def test_a_wrong_password_and_the_default_user_are_refused(acl: AclRedis, user: str) -> None:
    once = Retry(NoBackoff(), 0)  # the client retries a refused login as a connection error otherwise
    with pytest.raises(AuthenticationError, match="invalid username-password pair"):
        redis.Redis.from_url(acl.url(user, password=acl.passwords[user][::-1]), retry=once).ping()
    with pytest.raises(AuthenticationError):
        redis.Redis(port=acl.port, retry=once).ping()  # no credentials: the default user, disabled
    with pytest.raises(AuthenticationError, match="invalid username-password pair"):
        redis.Redis(port=acl.port, username="default", password=acl.passwords[user], retry=once).ping()
    assert redis.Redis.from_url(acl.url(user), retry=once).ping()


ENV = {
    **os.environ,
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "STREAMRL_WEIGHTS_KEY": "acl-test-weights-key-0123456789",
}


@pytest.mark.slow
def test_a_smoke_run_completes_with_every_service_under_its_own_user(
    acl: AclRedis, tiny_task: Path, tmp_path: Path, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    """The four real services, each logged in as itself: the run reaches total_steps, nothing is
    refused, and each one's password is in no log line."""
    recipe = write_recipe(tiny_task, tmp_path / "run", None, dense_reward=True)
    logs = {name: tmp_path / f"{name}.log" for name in SERVICES}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "streamrl.ops.cli", name, str(recipe), f"--instance={name}-0"],
            env={**ENV, "STREAMRL_RUN_ID": RUN, "STREAMRL_REDIS__URL": acl.url(name)},
            stdout=logs[name].open("wb"),
            stderr=subprocess.STDOUT,
        )
        for name in SERVICES
    }
    try:
        code = procs["coordinator"].wait(480)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = {name: log.read_text(errors="replace") for name, log in logs.items()}
    assert code == 0, "\n".join(f"--- {n}\n{t[-3000:]}" for n, t in text.items())
    assert refusals(acl) == []
    admin = acl.client("admin")
    trained = [m for _, f in admin.xrange(acl.names.weights) if (m := decode(f[b"d"])) and m.metrics]  # type: ignore[union-attr]
    assert [w.version for w in trained] == [1, 2, 3, 4]
    assert all(proc.returncode == 0 for proc in procs.values()), {n: p.returncode for n, p in procs.items()}
    for name, password in acl.passwords.items():
        assert not any(password in t for t in text.values()), f"the {name} password was logged"
