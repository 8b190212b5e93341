"""The rollout worker's weight follower: a version superseded while it waited is skipped at once
for the newer one (no retry pause, no ERROR), and a version that fails for another reason is retried."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from streamrl.common.aio import cancel_and_wait, timeout
from streamrl.common.bus import Bus, connect
from streamrl.common.errors import WeightSyncError
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.service import RolloutService


def _weights(version: int) -> WeightsPublished:
    return WeightsPublished(
        version=version, step=version, batch_id="", checksum="c", num_bytes=1, num_buckets=1, endpoint="tcp://learner:1"
    )


class _Engine:
    """Fails version 1 after the learner published version 2 (as a ZMQ server that moved on does);
    fails version 3 once for no such reason."""

    def __init__(self, bus: Bus, names: StreamNames) -> None:
        self.version = 0
        self.bus, self.names = bus, names
        self.failed_3 = False

    async def update_weights(self, event: WeightsPublished, timeout_s: float) -> None:
        version = event.version
        if version == 1:
            await self.bus.publish(self.names.weights, _weights(2))
            raise WeightSyncError("version 1 is not served (current version: 2)")
        if version == 3 and not self.failed_3:
            self.failed_3 = True
            raise WeightSyncError("missed its deadline")
        self.version = version


def test_superseded_versions_are_skipped_and_failures_retried(
    redis_url: str, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> tuple[float, float]:
        redis = connect(redis_url)
        bus, names = Bus(redis), StreamNames(run_id)
        config = RolloutConfig(engine=EngineConfig(model="unused"))
        ctx = ServiceContext("rollout", "rollout-0", config, bus, names, asyncio.Event())  # type: ignore[arg-type]
        engine = _Engine(bus, names)
        service = RolloutService(config, ctx, engine)  # type: ignore[arg-type]
        tail = asyncio.create_task(service._tail_weights("0-0"))
        try:
            started = time.monotonic()
            await bus.publish(names.weights, _weights(1))
            while engine.version < 2:
                await asyncio.sleep(0.01)
            skipped = time.monotonic() - started
            started = time.monotonic()
            await bus.publish(names.weights, _weights(3))
            while engine.version < 3:
                await asyncio.sleep(0.01)
            retried = time.monotonic() - started
        finally:
            await cancel_and_wait([tail])
            await redis.aclose()
        return skipped, retried

    with caplog.at_level(logging.WARNING, logger="streamrl.rollout.service"):
        skipped, retried = asyncio.run(asyncio.wait_for(scenario(), timeout=20))
    assert skipped < 0.8, f"a superseded version held the follower for {skipped:.2f} s"
    assert retried >= 0.9, "another failure is retried after a pause"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["weight sync to version 3 failed: missed its deadline"], errors


class _Recorder:
    """Takes every version; version 5 makes it fail with an error that is not a weight-sync one."""

    def __init__(self) -> None:
        self.version = 0

    async def update_weights(self, event: WeightsPublished, timeout_s: float) -> None:
        version = event.version
        if version == 5:
            raise RuntimeError("engine crashed while loading")
        self.version = version

    def close(self) -> None:
        pass


def _service(redis_url: str, run_id: str, engine: object) -> tuple[RolloutService, Bus, StreamNames]:
    bus, names = Bus(connect(redis_url)), StreamNames(run_id)
    config = RolloutConfig(engine=EngineConfig(model="unused"))
    ctx = ServiceContext("rollout", "rollout-0", config, bus, names, asyncio.Event())  # type: ignore[arg-type]
    return RolloutService(config, ctx, engine), bus, names  # type: ignore[arg-type]


def test_an_undecodable_weights_entry_is_skipped_with_a_reason(
    redis_url: str, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> int:
        engine = _Recorder()
        service, bus, names = _service(redis_url, run_id, engine)
        await bus.redis.xadd(names.weights, {"d": b"\x93not msgpack of a message"})
        assert await service._load_latest_weights() != "0-0"  # late joiner: the bad newest entry is passed over
        tail = asyncio.create_task(service._tail_weights("0-0"))
        try:
            await bus.redis.xadd(names.weights, {"d": b"garbage"})
            await bus.publish(names.weights, _weights(1))
            while engine.version < 1 and not tail.done():
                await asyncio.sleep(0.01)
        finally:
            await cancel_and_wait([tail])
            await bus.redis.aclose()
        return engine.version

    with caplog.at_level(logging.ERROR, logger="streamrl.rollout.service"):
        assert asyncio.run(asyncio.wait_for(scenario(), timeout=20)) == 1
    assert any("skipping weights entry" in r.getMessage() for r in caplog.records)


def test_a_dead_weight_follower_stops_the_worker(redis_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ServiceContext, "mark_running", lambda self: None)  # no gc.freeze in the test process

    async def scenario() -> None:
        service, bus, names = _service(redis_url, run_id, _Recorder())
        run = asyncio.create_task(service.run())
        try:
            await asyncio.sleep(0.3)
            await bus.publish(names.weights, _weights(5))
            await asyncio.wait_for(run, timeout=15)
        finally:
            await bus.redis.aclose()

    with pytest.raises(RuntimeError, match="the weight update died"):  # (its update task: the follower reads on)
        asyncio.run(scenario())


def test_weights_events_signed_with_another_key_are_refused(
    redis_url: str, run_id: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the run's weights key set, a worker applies only events the learner signed with it: a
    forged event (another key, or none) pointing at other weights is refused with a clear error, and
    the worker goes on to the next genuine version."""
    from streamrl.common.weights.auth import KEY_ENV, sign

    monkeypatch.setenv(KEY_ENV, "the-run-key-0123456789")
    run_key, other_key = b"the-run-key-0123456789", b"someone-else-0123456789"

    async def scenario() -> list[str]:
        engine = _Recorder()
        service, bus, names = _service(redis_url, run_id, engine)
        endpoints: list[str] = []
        real_update = engine.update_weights

        async def update(event: WeightsPublished, timeout_s: float) -> None:
            endpoints.append(event.endpoint)
            await real_update(event, timeout_s)

        engine.update_weights = update  # type: ignore[method-assign]
        tail = asyncio.create_task(service._tail_weights("0-0"))
        try:
            forged = WeightsPublished(
                version=7, step=7, batch_id="", checksum="c", num_bytes=1, num_buckets=1, endpoint="tcp://attacker:6666"
            )
            await bus.publish(names.weights, sign(forged, other_key, run_id=run_id))
            await bus.publish(names.weights, forged)
            await bus.publish(names.weights, sign(_weights(1), run_key, run_id=run_id))
            while engine.version < 1 and not tail.done():
                await asyncio.sleep(0.01)
        finally:
            await cancel_and_wait([tail])
            await bus.redis.aclose()
        return endpoints

    with caplog.at_level(logging.ERROR, logger="streamrl.rollout.service"):
        assert asyncio.run(asyncio.wait_for(scenario(), timeout=20)) == ["tcp://learner:1"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(
        f"weights version 7 is not signed with this run's key (STREAMRL_WEIGHTS_KEY) for run '{run_id}'" in e
        for e in errors
    )
    assert any("weights version 7 is not signed; this worker requires" in e for e in errors)


def test_an_event_signed_for_another_run_sharing_the_key_is_refused(
    redis_url: str, run_id: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs share the weights key (one key for a team, one Redis): run A's learner's genuine, signed
    event copied into run B's weights stream must not move B's workers to A's weights."""
    from streamrl.common.weights.auth import KEY_ENV, sign

    key = b"one-key-for-two-runs-0123"
    monkeypatch.setenv(KEY_ENV, key.decode())

    async def scenario() -> list[tuple[str, int]]:
        engine = _Recorder()
        service, bus, names = _service(redis_url, run_id, engine)
        loads: list[tuple[str, int]] = []
        real_update = engine.update_weights

        async def update(event: WeightsPublished, timeout_s: float) -> None:
            loads.append((event.endpoint, event.version))
            await real_update(event, timeout_s)

        engine.update_weights = update  # type: ignore[method-assign]
        tail = asyncio.create_task(service._tail_weights("0-0"))
        try:
            of_run_a = WeightsPublished(
                version=9,
                step=9,
                batch_id="",
                checksum="c",
                num_bytes=1,
                num_buckets=1,
                endpoint="tcp://learner-of-run-a:5555",
            )
            await bus.publish(names.weights, sign(of_run_a, key, run_id=f"{run_id}-a"))
            await bus.publish(names.weights, sign(_weights(1), key, run_id=run_id))
            while engine.version < 1 and not tail.done():
                await asyncio.sleep(0.01)
        finally:
            await cancel_and_wait([tail])
            await bus.redis.aclose()
        return loads

    with caplog.at_level(logging.ERROR, logger="streamrl.rollout.service"):
        assert asyncio.run(asyncio.wait_for(scenario(), timeout=20)) == [("tcp://learner:1", 1)]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(
        f"weights version 9 is not signed with this run's key (STREAMRL_WEIGHTS_KEY) for run '{run_id}'" in e
        for e in errors
    ), errors


class _Loads:
    """Records every load (endpoint, version, checksum); the old learner's endpoint is dead."""

    def __init__(self) -> None:
        self.version = 0
        self.loads: list[tuple[str, int, str]] = []

    async def update_weights(self, event: WeightsPublished, timeout_s: float) -> None:
        endpoint = event.endpoint
        version = event.version
        checksum = event.checksum
        if endpoint == "tcp://dead-learner:1":
            await asyncio.sleep(0.2)
            raise WeightSyncError(f"version {version}: no answer from {endpoint} within the deadline")
        self.loads.append((endpoint, version, checksum))
        self.version = version

    def close(self) -> None:
        pass


def test_a_version_republished_by_a_restarted_learner_replaces_the_lost_one(redis_url: str, run_id: str) -> None:
    """The learner published version 2 and died before any worker fetched it (its endpoint is gone);
    restarted, it publishes version 2 again with retrained weights (another checksum, another endpoint).
    A worker stuck on the lost one takes the new one; a worker that held the old version 2 reloads;
    the same version with the same checksum is never loaded twice."""
    engine = _Loads()

    def event(version: int, checksum: str, endpoint: str) -> WeightsPublished:
        return WeightsPublished(
            version=version, step=version, batch_id="", checksum=checksum, num_bytes=1, num_buckets=1, endpoint=endpoint
        )

    async def scenario() -> None:
        service, bus, names = _service(redis_url, run_id, engine)
        tail = asyncio.create_task(service._tail_weights("0-0"))
        try:
            await bus.publish(names.weights, event(1, "a", "tcp://old-learner:1"))
            # the worker jumps to the newest version it reads: let it take version 1 before version 2 lands
            while engine.version < 1:
                await asyncio.sleep(0.01)
            await bus.publish(names.weights, event(2, "b", "tcp://dead-learner:1"))
            await asyncio.sleep(0.5)  # the worker keeps failing on the lost version 2
            assert engine.version == 1
            await bus.publish(names.weights, event(2, "c", "tcp://new-learner:1"))
            while engine.version < 2:
                await asyncio.sleep(0.01)
            await bus.publish(names.weights, event(2, "c", "tcp://new-learner:1"))  # nothing new
            await bus.publish(names.weights, event(2, "d", "tcp://newer-learner:1"))  # restarted once more
            while len(engine.loads) < 3:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
        finally:
            await cancel_and_wait([tail])
            await bus.redis.aclose()

    asyncio.run(asyncio.wait_for(scenario(), timeout=20))
    assert engine.loads == [
        ("tcp://old-learner:1", 1, "a"),
        ("tcp://new-learner:1", 2, "c"),
        ("tcp://newer-learner:1", 2, "d"),
    ]


class _Stuck:
    """A fetch from the dead learner's endpoint hangs (as one does until the sync deadline) until given up."""

    def __init__(self) -> None:
        self.version = 0
        self.loads: list[tuple[str, int]] = []
        self.abandoned: list[str] = []

    async def update_weights(self, event: WeightsPublished, timeout_s: float) -> None:
        endpoint = event.endpoint
        version = event.version
        if endpoint == "tcp://dead-learner:1":
            try:
                await asyncio.sleep(timeout_s)
            except asyncio.CancelledError:
                self.abandoned.append(endpoint)
                raise
            raise WeightSyncError("missed its deadline")
        self.loads.append((endpoint, version))
        self.version = version

    def close(self) -> None:
        pass


def test_a_fetch_stuck_on_a_dead_learner_is_abandoned_for_the_republished_version(redis_url: str, run_id: str) -> None:
    """The learner published version 1 and was killed; the worker's fetch from its endpoint hangs. The
    restarted learner publishes version 1 again (same weights, another endpoint): the worker gives the stuck
    fetch up at once and loads the republished one - not after ``rollout.weight_sync_timeout_s`` (120 s)."""
    engine = _Stuck()

    def event(endpoint: str) -> WeightsPublished:
        return WeightsPublished(
            version=1, step=1, batch_id="", checksum="c", num_bytes=1, num_buckets=1, endpoint=endpoint
        )

    async def scenario() -> float:
        service, bus, names = _service(redis_url, run_id, engine)
        tail = asyncio.create_task(service._tail_weights("0-0"))
        try:
            await bus.publish(names.weights, event("tcp://dead-learner:1"))
            await asyncio.sleep(0.5)  # the worker is stuck in the fetch
            assert engine.version == 0 and not engine.abandoned
            started = time.monotonic()
            await bus.publish(names.weights, event("tcp://restarted-learner:1"))
            async with timeout(30):
                while engine.version < 1:
                    await asyncio.sleep(0.01)
            return time.monotonic() - started
        finally:
            await cancel_and_wait([tail])
            await bus.redis.aclose()

    took = asyncio.run(scenario())
    assert took < 2.0, f"the republished version was loaded {took:.1f} s after it was published"
    assert engine.abandoned == ["tcp://dead-learner:1"]
    assert engine.loads == [("tcp://restarted-learner:1", 1)]


class _FailsTwice:
    """Version 2 fails its first two syncs (its server not up yet); every other version loads."""

    def __init__(self) -> None:
        self.version = 0
        self.failures = 0

    async def update_weights(self, event: WeightsPublished, timeout_s: float) -> None:
        version = event.version
        if version == 2 and self.failures < 2:
            self.failures += 1
            raise WeightSyncError("the server did not answer the connection within its deadline")
        self.version = version

    def close(self) -> None:
        pass


def test_an_event_of_an_older_version_does_not_end_the_retries_of_a_newer_one(redis_url: str, run_id: str) -> None:
    """A restarted learner publishes its checkpoint's version (1) again while the worker retries version 2: the
    older event is no reason to give version 2 up (it would wait for the next version for ever)."""
    engine = _FailsTwice()

    async def scenario() -> None:
        service, bus, names = _service(redis_url, run_id, engine)
        tail = asyncio.create_task(service._tail_weights("0-0"))
        try:
            await bus.publish(names.weights, _weights(2))
            async with timeout(10):
                while engine.failures < 1:
                    await asyncio.sleep(0.01)
            await bus.publish(names.weights, _weights(1))
            async with timeout(30):
                while engine.version < 2:
                    await asyncio.sleep(0.01)
        finally:
            await cancel_and_wait([tail])
            await bus.redis.aclose()

    asyncio.run(scenario())
    assert engine.version == 2 and engine.failures == 2
