"""The consumer loop against a real redis-server: crash recovery, dead letters, drain, wire format."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis

from streamrl.common.codec import decode
from streamrl.common.consumer import encode_payload
from streamrl.common.health import live_heartbeats
from streamrl.common.messages import DeadLetter, ScoredTrajectory, Tensor, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.ops.redis_server import RedisServer

WORKER = Path(__file__).with_name("bus_worker.py")


def make_trajectory(i: int, num_tokens: int = 8) -> Trajectory:
    return Trajectory(
        id=f"g{i}/0",
        group_id=f"g{i}",
        group_index=0,
        group_size=1,
        prompt_ids=Tensor.from_list([1, 2, 3], "int32"),
        response_ids=Tensor.from_numpy(np.arange(num_tokens, dtype=np.int32) + i),
        logprobs=Tensor.from_numpy(np.full(num_tokens, -0.5, dtype=np.float32)),
        loss_mask=Tensor.from_numpy(np.ones(num_tokens, dtype=np.uint8)),
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )


def start_worker(redis_url: str, run_id: str, instance: str, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        str(WORKER),
        f"--redis.url={redis_url}",
        f"--run_id={run_id}",
        f"--instance={instance}",
        "--consumer.heartbeat_interval_s=0.2",
        "--consumer.claim_interval_s=0.2",
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # output to a file: an unread pipe fills up and blocks a chatty worker
    log = tempfile.NamedTemporaryFile(prefix=f"bus-worker-{instance}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = Path(log.name)  # type: ignore[attr-defined]
    return proc


def wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def scored_ids(client: redis.Redis, names: StreamNames) -> list[str]:
    return [decode(f[b"d"], ScoredTrajectory).trajectory.id for _, f in client.xrange(names.scored)]


def pending(client: redis.Redis, names: StreamNames) -> int:
    return int(client.xpending(names.trajectories, "reward")["pending"])


@pytest.mark.parametrize("claim_idle_ms", [500, 30_000], ids=["idle-claim", "heartbeat-expired"])
def test_sigkill_mid_batch_loses_nothing_and_duplicates_nothing(
    claim_idle_ms: int, redis_url: str, run_id: str
) -> None:
    """A replacement worker (another instance name) takes over a killed one's entries: after they
    idle claim_idle_ms, or at once when the killed instance's heartbeat has expired (here well
    before the 30 s claim_idle_ms)."""
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    num = 200  # ~3.8 s of work for the victim: a loaded machine cannot let it finish before the kill
    for i in range(num):
        client.xadd(names.trajectories, encode_payload(make_trajectory(i)))
    victim = start_worker(redis_url, run_id, "victim", "--echo.delay_s=0.3", "--consumer.max_in_flight=16")
    # killed mid-batch (its entries are read and acknowledged 16 at a time: not between two batches)
    wait_for(lambda: len(scored_ids(client, names)) >= 5 and pending(client, names) > 0, 30, "the first outputs")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    consumers = client.xinfo_consumers(names.trajectories, "reward")
    assert pending(client, names) > 0, f"the killed consumer should have left entries pending (consumers {consumers})"
    done_before = len(scored_ids(client, names))
    assert done_before < num
    time.sleep(0.5)  # the heartbeat (TTL 0.4 s) has expired: a status display lists the live ones meanwhile
    assert "echo:victim" not in {b.instance for b in live_heartbeats(client, names)}
    rescuer = start_worker(redis_url, run_id, "rescuer", f"--consumer.claim_idle_ms={claim_idle_ms}")
    try:
        wait_for(lambda: len(scored_ids(client, names)) >= num and pending(client, names) == 0, 20, "all outputs")
        time.sleep(1.0)  # let any would-be duplicate land
        ids = scored_ids(client, names)
        assert len(ids) == num
        assert sorted(ids) == sorted(f"g{i}/0" for i in range(num))
        assert pending(client, names) == 0
        consumers = [c["name"] for c in client.xinfo_consumers(names.trajectories, "reward")]
        assert b"victim" not in consumers, "the dead consumer is forgotten once its entries are taken over"
        assert b"echo:victim" not in client.smembers(names.instances)
    finally:
        rescuer.send_signal(signal.SIGTERM)
        assert rescuer.wait(20) == 0


def test_work_slower_than_claim_idle_is_not_claimed_again(redis_url: str, run_id: str) -> None:
    """A live consumer keeps what it is working on: no second delivery (no duplicate work), nothing dead."""
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for i in range(3):
        client.xadd(names.trajectories, encode_payload(make_trajectory(i)))
    worker = start_worker(
        redis_url, run_id, "slow", "--echo.delay_s=2.0", "--consumer.claim_idle_ms=300", "--consumer.max_deliveries=1"
    )
    try:

        def taken() -> bool:
            try:
                return pending(client, names) == 3
            except redis.ResponseError:  # the group is not created yet
                return False

        wait_for(taken, 20, "the entries to be taken")
        time.sleep(1.2)  # four claim cycles with a 300 ms idle limit while the handler works
        held = client.xpending_range(names.trajectories, "reward", min="-", max="+", count=10)
        assert [h["times_delivered"] for h in held] == [1, 1, 1]
        wait_for(lambda: len(scored_ids(client, names)) >= 3 and pending(client, names) == 0, 30, "all outputs")
        assert sorted(scored_ids(client, names)) == ["g0/0", "g1/0", "g2/0"]
        assert client.xlen(names.dead) == 0
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(20) == 0


def test_work_held_with_every_slot_busy_is_not_claimed_by_another_consumer(redis_url: str, run_id: str) -> None:
    """A consumer whose every in-flight slot is busy (here its one slot, on work slower than
    claim_idle_ms) still keeps what it holds alive: a second consumer never takes it over."""
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    client.xadd(names.trajectories, encode_payload(make_trajectory(0)))
    settings = ("--echo.delay_s=3.0", "--consumer.claim_idle_ms=800", "--consumer.max_deliveries=1")
    busy = start_worker(redis_url, run_id, "busy", *settings, "--consumer.max_in_flight=1")
    other = None
    try:
        wait_for(lambda: client.exists(names.trajectories) and _held(client, names) == 1, 20, "the entry to be taken")
        other = start_worker(redis_url, run_id, "other", *settings)
        time.sleep(2.0)  # the entry would idle past 800 ms twice over
        held = client.xpending_range(names.trajectories, "reward", min="-", max="+", count=10)
        assert [(h["consumer"], h["times_delivered"]) for h in held] == [(b"busy", 1)]  # never claimed by "other"
        wait_for(lambda: len(scored_ids(client, names)) >= 1 and pending(client, names) == 0, 30, "the output")
        assert scored_ids(client, names) == ["g0/0"]
        assert client.xlen(names.dead) == 0
    finally:
        for worker in (busy, other):
            if worker is not None:
                worker.send_signal(signal.SIGTERM)
                assert worker.wait(20) == 0


def _held(client: redis.Redis, names: StreamNames) -> int:  # type: ignore[type-arg]
    try:
        return pending(client, names)
    except redis.ResponseError:  # the group is not created yet
        return 0


def test_poison_and_failing_entries_are_dead_lettered_while_the_loop_keeps_running(redis_url: str, run_id: str) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    client.xadd(names.trajectories, {b"d": b"\xc1 not msgpack"})
    client.xadd(names.trajectories, {b"d": msgpack.packb({"type": "trajectory", "v": 99})})
    client.xadd(names.trajectories, {b"d": msgpack.packb({"type": "spaceship", "v": 1})})
    client.xadd(names.trajectories, encode_payload(make_trajectory(0)))  # always fails in the handler
    for i in range(1, 6):
        client.xadd(names.trajectories, encode_payload(make_trajectory(i)))
    worker = start_worker(
        redis_url,
        run_id,
        "w",
        '--echo.fail_ids=["g0/0"]',
        "--consumer.max_deliveries=3",
        "--consumer.retry_delay_s=0.05",
    )
    try:
        wait_for(lambda: client.xlen(names.dead) >= 4 and len(scored_ids(client, names)) >= 5, 30, "dead letters")
        letters = [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]
        reasons = " | ".join(letter.error for letter in letters)
        assert "undecodable" in reasons
        assert "unsupported version v=99" in reasons
        assert "unknown message type 'spaceship'" in reasons
        failed = [letter for letter in letters if "scorer exploded on g0/0" in letter.error]
        assert len(failed) == 1 and failed[0].deliveries == 3
        assert decode(failed[0].payload, Trajectory).id == "g0/0"  # the original payload is kept
        assert sorted(scored_ids(client, names)) == [f"g{i}/0" for i in range(1, 6)]
        wait_for(lambda: pending(client, names) == 0, 10, "acks")
        assert worker.poll() is None, "the loop must keep running"
        # still consuming after the poison
        client.xadd(names.trajectories, encode_payload(make_trajectory(7)))
        wait_for(lambda: "g7/0" in scored_ids(client, names), 10, "a message after the poison")
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(20) == 0


def test_sigterm_drains_in_flight_work(redis_url: str, run_id: str) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    worker = start_worker(redis_url, run_id, "w", "--echo.delay_s=1.5", "--consumer.max_in_flight=8")
    wait_for(lambda: client.exists(names.heartbeat("echo", "w")), 20, "heartbeat")
    for i in range(8):
        client.xadd(names.trajectories, encode_payload(make_trajectory(i)))
    wait_for(lambda: pending(client, names) == 8, 10, "all 8 in flight")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    assert len(scored_ids(client, names)) == 8, "in-flight work must finish before exit"
    assert pending(client, names) == 0
    # entries arriving after SIGTERM are not taken
    assert not client.exists(names.heartbeat("echo", "w"))


def test_health_check_follows_the_heartbeat(redis_url: str, run_id: str) -> None:
    worker = start_worker(redis_url, run_id, "hc")
    check = [sys.executable, str(WORKER), f"--redis.url={redis_url}", f"--run_id={run_id}", "--check", "--instance=hc"]
    try:
        wait_for(lambda: subprocess.run(check, capture_output=True).returncode == 0, 20, "healthy")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(20)
    time.sleep(0.5)
    assert subprocess.run(check, capture_output=True).returncode == 1


def test_message_roundtrips_through_plain_msgpack(redis_url: str, run_id: str) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    traj = make_trajectory(3, num_tokens=4)
    client.xadd(names.trajectories, encode_payload(traj))
    ((_, fields),) = client.xrange(names.trajectories)
    plain = msgpack.unpackb(fields[b"d"], raw=False)
    assert plain["type"] == "trajectory" and plain["v"] == 1
    assert plain["id"] == "g3/0" and plain["group_id"] == "g3" and plain["group_size"] == 1
    assert plain["traceparent"].startswith("00-0af7651916cd43dd")
    ids = plain["response_ids"]
    assert ids["dtype"] == "int32" and ids["shape"] == [4]
    assert np.frombuffer(ids["data"], dtype=ids["dtype"]).tolist() == [3, 4, 5, 6]
    lp = plain["logprobs"]
    assert np.frombuffer(lp["data"], dtype=lp["dtype"]).tolist() == [-0.5] * 4
    # and a map written by another msgpack producer decodes into the typed message
    assert decode(msgpack.packb(plain), Trajectory) == traj


@pytest.mark.parametrize("payload", [b"", b"\x93\x01\x02\x03", msgpack.packb({"v": 1})])
def test_bad_payloads_raise_a_clear_error(payload: bytes) -> None:
    from streamrl.common.errors import PoisonMessageError

    with pytest.raises(PoisonMessageError):
        decode(payload)


def test_batched_commits_keep_their_own_outcome(redis_url: str, run_id: str) -> None:
    """Commits sent in one script call: written, duplicate, or failed each on its own; a failed one
    is not acknowledged, so its retry writes its outputs."""
    import asyncio

    from streamrl.common.bus import Bus, CommitBatcher, Output, connect

    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(names.trajectories, "reward", id="0", mkstream=True)
    entries = [client.xadd(names.trajectories, encode_payload(make_trajectory(i))).decode() for i in range(4)]
    client.xreadgroup("reward", "c", {names.trajectories: ">"})
    client.set(f"{run_id}:not-a-hash", "x")  # a key of the wrong type: HSET on it fails

    async def commit_all() -> list[object]:
        bus = Bus(connect(redis_url))
        batcher = CommitBatcher(bus)
        client.xack(names.trajectories, "reward", entries[2])  # entry 2 was handled before (say, by another consumer)
        calls = []
        for i in range(4):  # entries 0-2 go to the scored stream, entry 3 to the key of the wrong type
            out = (
                Output(stream=names.scored, message=make_trajectory(i))
                if i < 3
                else Output(key=f"{run_id}:not-a-hash", field="f", message=make_trajectory(i))
            )
            calls.append(batcher.commit([out], ack_stream=names.trajectories, ack_group="reward", ack_entry=entries[i]))
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        held = client.xpending_range(names.trajectories, "reward", min="-", max="+", count=10)
        assert [h["message_id"].decode() for h in held] == [entries[3]]  # the failed one only
        retry = await bus.commit(
            [Output(stream=names.scored, message=make_trajectory(3))],
            ack_stream=names.trajectories,
            ack_group="reward",
            ack_entry=entries[3],
        )
        await bus.redis.aclose()
        return [*outcomes, retry]

    written_0, written_1, duplicate, failed, retried = asyncio.run(commit_all())
    assert (written_0, written_1, duplicate, retried) == (True, True, False, True)
    assert isinstance(failed, redis.exceptions.ResponseError) and "WRONGTYPE" in str(failed)
    assert [decode(f[b"d"], Trajectory).id for _, f in client.xrange(names.scored)] == ["g0/0", "g1/0", "g3/0"]
    assert pending(client, names) == 0


# A service rides out a Redis restart: redis-server SIGKILLed mid-run and back on the same port
# 3 s later (AOF, fsync always). The worker neither exits nor loses or duplicates an entry; it says
# so in one line when Redis goes and one when it is back.
def test_worker_rides_out_a_redis_restart(tmp_path: Path, run_id: str) -> None:
    server = RedisServer(tmp_path / "redis", appendfsync="always").start()
    client = redis.Redis.from_url(server.url)
    names = StreamNames(run_id)
    worker = start_worker(server.url, run_id, "w", "--echo.delay_s=0.05", "--consumer.max_in_flight=4")
    try:
        for i in range(40):
            client.xadd(names.trajectories, encode_payload(make_trajectory(i)))
        wait_for(lambda: len(scored_ids(client, names)) >= 10, 30, "the first outputs")
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        time.sleep(3)
        assert worker.poll() is None, "the worker exited when redis went away"
        server.start()
        client = redis.Redis.from_url(server.url)
        for i in range(40, 60):
            client.xadd(names.trajectories, encode_payload(make_trajectory(i)))
        wait_for(lambda: len(scored_ids(client, names)) >= 60 and pending(client, names) == 0, 60, "every output")
        ids = scored_ids(client, names)
        assert sorted(ids) == sorted(f"g{i}/0" for i in range(60)), "lost or duplicated outputs"
        assert worker.poll() is None
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
        server.stop()
    text = worker.log_path.read_text()  # type: ignore[attr-defined]
    assert worker.returncode == 0, text[-3000:]
    assert text.count("redis unreachable") == 1 and text.count("redis is back") == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_messages_over_the_size_limit_are_refused_and_dead_lettered(redis_url: str, run_id: str) -> None:
    """redis.max_message_mb: an entry over it is dead-lettered unread (its payload cut to 64 KiB) and
    the loop goes on; writing one is refused with the stream, the size and the limit named."""
    import asyncio

    from streamrl.common.bus import Bus, connect
    from streamrl.common.errors import MessageTooLargeError

    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    client.xadd(names.trajectories, encode_payload(make_trajectory(0, num_tokens=200_000)))  # ~1.7 MiB
    client.xadd(names.trajectories, encode_payload(make_trajectory(1)))
    worker = start_worker(redis_url, run_id, "w", "--redis.max_message_mb=1")
    try:
        wait_for(lambda: client.xlen(names.dead) >= 1 and len(scored_ids(client, names)) >= 1, 30, "the outcomes")
        (letter,) = [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]
        assert "MessageTooLargeError" in letter.error and "over the 1.0 MiB limit" in letter.error
        assert len(letter.payload) == 64 * 2**10
        assert scored_ids(client, names) == ["g1/0"]
        wait_for(lambda: pending(client, names) == 0, 10, "acks")
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(20) == 0

    async def publish_big() -> None:
        bus = Bus(connect(redis_url), max_message_bytes=2**20)
        try:
            await bus.publish(names.trajectories, make_trajectory(2, num_tokens=200_000))
        finally:
            await bus.redis.aclose()

    with pytest.raises(
        MessageTooLargeError, match=rf"Trajectory of 1\.7 MiB for {names.trajectories} is over the 1\.0 MiB"
    ):
        asyncio.run(publish_big())


def _tls_redis(tmp_path: Path, password: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """A redis-server that takes only TLS connections with a password; its CA certificate for clients."""
    from streamrl.ops.redis_server import find_redis_server, free_port

    d = tmp_path / "tls"
    d.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=streamrl-test-ca",
    )
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"
    )
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            find_redis_server(),
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(d / "server.crt"),
            "--tls-key-file",
            str(d / "server.key"),
            "--tls-ca-cert-file",
            str(d / "ca.crt"),
            "--tls-auth-clients",
            "no",
            "--requirepass",
            password,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(d),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    return proc, f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={d / 'ca.crt'}", d


def test_a_worker_runs_over_tls_with_a_password(tmp_path: Path, run_id: str) -> None:
    """``rediss://`` with the server's CA: the worker connects over TLS, handles entries, reports its
    health, and its password shows in no log line."""
    password = "tls-pass-4f9a"
    try:
        proc, url, _ = _tls_redis(tmp_path, password)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot make a TLS redis-server here: {e}")
    time.sleep(0.5)
    if proc.poll() is not None:
        pytest.skip(
            f"this redis-server has no TLS support: {proc.stderr.read().decode()[-300:] if proc.stderr else ''}"
        )
    worker = None
    try:
        client = redis.Redis.from_url(url, socket_timeout=5)
        wait_for(lambda: _pings(client), 10, "the TLS redis-server")
        names = StreamNames(run_id)
        for i in range(5):
            client.xadd(names.trajectories, encode_payload(make_trajectory(i)))
        worker = start_worker(url, run_id, "tls-worker")
        wait_for(lambda: len(scored_ids(client, names)) >= 5 and pending(client, names) == 0, 30, "the outputs")
        check = subprocess.run(
            [
                sys.executable,
                str(WORKER),
                f"--redis.url={url}",
                f"--run_id={run_id}",
                "--check",
                "--instance=tls-worker",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert check.returncode == 0 and "healthy" in check.stdout, check.stdout + check.stderr
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(20)
        proc.terminate()
        proc.wait(5)
    assert worker.returncode == 0
    assert password not in worker.log_path.read_text()  # type: ignore[attr-defined]


def test_a_wrong_password_stops_a_worker_at_once_with_a_clear_line(tmp_path: Path, run_id: str) -> None:
    """A refused login is not an outage: no minute of retries, one line saying what to check, and
    the (wrong) password shown nowhere."""
    from streamrl.ops.redis_server import find_redis_server, free_port

    port = free_port()
    server = subprocess.Popen(
        [
            find_redis_server(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            "the-right-one-1234",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        started = time.monotonic()
        worker = start_worker(f"redis://:not-this-5678@127.0.0.1:{port}/0", run_id, "w", "--redis.outage_s=60")
        code = worker.wait(30)
        elapsed = time.monotonic() - started
    finally:
        server.terminate()
        server.wait(5)
    log = worker.log_path.read_text()  # type: ignore[attr-defined]
    assert code != 0 and elapsed < 20, (code, elapsed, log[-2000:])
    assert "redis refused the login" in log and "check the user and password in redis.url" in log, log[-2000:]
    assert "not-this-5678" not in log
    assert "Traceback" not in log


def _pings(client: redis.Redis) -> bool:  # type: ignore[type-arg]
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_entries_whose_read_reply_was_lost_are_handled(redis_url: str, run_id: str) -> None:
    """A read that Redis ran but whose reply never reached the consumer (the connection dropped; the
    client's retry read the next entries) leaves entries pending under the consumer's name that it
    never received: they are handled, not kept alive unhandled for ever (before: stranded)."""
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    worker = start_worker(redis_url, run_id, "w1", "--consumer.claim_idle_ms=30000")
    try:

        def has_group() -> bool:
            return (
                any(g["name"] == b"reward" for g in client.xinfo_groups(names.trajectories))
                if client.exists(names.trajectories)
                else False
            )

        wait_for(has_group, 30, "the worker's group")
        for i in range(4):
            client.xadd(names.trajectories, encode_payload(make_trajectory(i)))
        # the lost read: delivered to w1 by Redis, never seen by the worker's loop
        client.xreadgroup("reward", "w1", {names.trajectories: ">"}, count=2)
        wait_for(lambda: len(scored_ids(client, names)) >= 4, 30, "every entry handled")
        wait_for(lambda: pending(client, names) == 0, 10, "nothing pending")
        assert sorted(scored_ids(client, names)) == ["g0/0", "g1/0", "g2/0", "g3/0"]
        assert client.xlen(names.dead) == 0
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(20) == 0
