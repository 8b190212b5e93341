"""One live process per instance name, one coordinator and one learner per run (real Redis, real
service processes: tests/integration/bus_worker.py run as the named service)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from streamrl.common.bus import connect
from streamrl.common.codec import decode
from streamrl.common.lease import Lease, LeaseHeldError, LeaseLostError
from streamrl.common.messages import Heartbeat
from streamrl.common.streams import StreamNames

WORKER = Path(__file__).with_name("bus_worker.py")
BEAT_S = 0.2


def _start(redis_url: str, run_id: str, service: str, instance: str, *extra: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        str(WORKER),
        f"--redis.url={redis_url}",
        f"--run_id={run_id}",
        f"--instance={instance}",
        f"--consumer.heartbeat_interval_s={BEAT_S}",
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BUS_WORKER_SERVICE": service}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _status(client: redis.Redis, names: StreamNames, service: str, instance: str, pid: int = 0) -> str | None:  # type: ignore[type-arg]
    """The status in the instance's heartbeat (None: none, or with ``pid``, none written by that process)."""
    raw = client.get(names.heartbeat(service, instance))
    beat = None if raw is None else decode(raw, Heartbeat)
    return None if beat is None or (pid and beat.pid != pid) else beat.status


def _wait(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _stop(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)


@pytest.mark.parametrize("service", ["coordinator", "learner"])
def test_a_second_coordinator_or_learner_refuses_to_start_naming_the_holder(
    service: str, redis_url: str, run_id: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    first = _start(redis_url, run_id, service, "first")
    second = None
    try:
        _wait(lambda: _status(client, names, service, "first") == "running", 20, "the first one to run")
        second = _start(redis_url, run_id, service, "second")
        out, _ = second.communicate(timeout=20)
        assert second.returncode == 1, out
        assert f"the {service} of run '{run_id}' is held by a live process (first@" in out
        assert first.poll() is None  # the first one goes on untouched
    finally:
        _stop(first)
    assert first.returncode == 0


def test_a_standby_coordinator_takes_over_when_the_holder_dies(redis_url: str, run_id: str) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    first = _start(redis_url, run_id, "coordinator", "first")
    standby = None
    try:
        _wait(lambda: _status(client, names, "coordinator", "first") == "running", 20, "the first one to run")
        standby = _start(redis_url, run_id, "coordinator", "standby", "--standby=true")
        _wait(lambda: _status(client, names, "coordinator", "standby") == "standby", 20, "the standby to wait")
        time.sleep(5 * BEAT_S)
        assert _status(client, names, "coordinator", "standby") == "standby"  # still waiting while the first lives
        first.kill()  # no release: the lease has to expire
        killed = time.monotonic()
        _wait(lambda: _status(client, names, "coordinator", "standby") == "running", 20, "the takeover")
        took = time.monotonic() - killed
        assert took < 3 * 2 * BEAT_S + 1.0, f"took over {took:.1f} s after the holder died"
    finally:
        _stop(first, *([standby] if standby else []))
    assert standby.returncode == 0


def test_a_live_instance_name_is_refused_and_a_killed_ones_is_taken_over(redis_url: str, run_id: str) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    first = _start(redis_url, run_id, "echo", "rollout-0")
    try:
        _wait(lambda: _status(client, names, "echo", "rollout-0") == "running", 20, "the first one to run")
        twin = _start(redis_url, run_id, "echo", "rollout-0")
        out, _ = twin.communicate(timeout=20)
        assert twin.returncode == 1, out
        assert "instance name echo/rollout-0 is held by a live process (rollout-0@" in out
        first.kill()  # a replacement under the same name (a restarted replica) waits for the lease to expire
        again = _start(redis_url, run_id, "echo", "rollout-0")
        _wait(
            lambda: again.poll() is not None or _status(client, names, "echo", "rollout-0", again.pid) == "running",
            20,
            "the replacement to run",
        )
        assert again.poll() is None
    finally:
        _stop(first)
    _stop(again)
    assert again.returncode == 0


def test_a_lost_lease_is_noticed_at_renewal_and_never_released_from_its_successor(redis_url: str) -> None:
    async def scenario() -> None:
        client = connect(redis_url)
        key = f"test:lease:{time.time_ns()}"
        try:
            first = Lease(client, key, "a@h:1/x", ttl_s=0.3, what="the thing")
            second = Lease(client, key, "b@h:2/y", ttl_s=0.3, what="the thing")
            assert await first.acquire(wait_s=0)
            with pytest.raises(LeaseHeldError, match=r"the thing is held by a live process \(a@h:1\)"):
                await second.acquire(wait_s=0.1)
            await asyncio.sleep(0.5)  # the holder stalled past its TTL, nobody took it: it holds it again
            await first.renew()
            assert await client.get(key) == b"a@h:1/x"
            await asyncio.sleep(0.5)  # stalled again, and this time another process takes it
            assert await second.acquire(wait_s=0)
            with pytest.raises(LeaseLostError, match=r"lost the lease on the thing .*now held by b@h:2"):
                await first.renew()
            await first.release()  # never deletes the successor's lease
            assert await client.get(key) == b"b@h:2/y"
            await second.renew()
            await second.release()
            assert await client.get(key) is None
        finally:
            await client.aclose()

    asyncio.run(scenario())


class _ResentClient:
    """A client whose every command runs twice, the caller seeing the second reply: what a lost reply
    and the client's outage retry re-sending the command do."""

    def __init__(self, client: object) -> None:
        self.client = client

    def __getattr__(self, name: str) -> object:
        command = getattr(self.client, name)

        async def twice(*args: object, **kwargs: object) -> object:
            await command(*args, **kwargs)
            return await command(*args, **kwargs)

        return twice


def test_a_renewal_whose_reply_was_lost_keeps_the_lease(redis_url: str) -> None:
    """An expired lease re-taken by a renewal whose reply was lost: the re-sent renewal finds the lease
    its first run took (before: 'lost the lease ... now held by' the process itself, and it stopped)."""

    async def scenario() -> None:
        client = connect(redis_url)
        key = f"test:lease:{time.time_ns()}"
        try:
            lease = Lease(_ResentClient(client), key, "a@h:1/x", ttl_s=0.3, what="the thing")  # type: ignore[arg-type]
            assert await lease.acquire(wait_s=0)
            await asyncio.sleep(0.5)  # expired, nobody took it
            await lease.renew()
            assert await client.get(key) == b"a@h:1/x"
            await lease.renew()  # held: extended, twice
            assert 0 < await client.pttl(key) <= 300
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_stalled_holder_never_takes_back_a_lease_a_standby_held_meanwhile(redis_url: str) -> None:
    """Issue 38: the learner stalled past its lease TTL; its standby took the lease over, worked, and released it
    (stopped) - or died holding it. The stalled learner, waking, must not take the free lease back as if nobody
    had held it: it stops (LeaseLostError) instead of resuming beside what its successor did. Nobody having taken
    it, it still takes it back (test above)."""

    async def scenario(successor_dies: bool) -> None:
        client = connect(redis_url)
        key = f"test:lease:{time.time_ns()}"
        try:
            stalled = Lease(client, key, "learner@h:1/x", ttl_s=0.3, what="the learner of run r")
            standby = Lease(client, key, "learner@h:2/y", ttl_s=0.3, what="the learner of run r")
            assert await stalled.acquire(wait_s=0)
            await asyncio.sleep(0.5)  # stalled past the TTL: the standby takes over
            assert await standby.acquire(wait_s=0)
            if successor_dies:
                await asyncio.sleep(0.5)  # it died: its lease expired
            else:
                await standby.release()  # it stopped
            assert await client.get(key) is None
            with pytest.raises(LeaseLostError, match="another process took it over meanwhile and gave it up"):
                await stalled.renew()
            assert await client.get(key) is None
            assert await standby.acquire(wait_s=0)  # a later take is unaffected
            await standby.renew()
        finally:
            await client.aclose()

    asyncio.run(scenario(successor_dies=False))
    asyncio.run(scenario(successor_dies=True))
