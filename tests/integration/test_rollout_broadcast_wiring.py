"""The rollout worker with a weights event that advertises a broadcast rendezvous: it updates as a
member of the group, falls back to ZMQ when it cannot join and the learner serves there, says which
learner setting to change when it does not, and reports the version the engine serves (exactly the
event's: engines refuse any other staged version, tests/integration/test_broadcast_engines.py)."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.common.bus import Bus, connect
from streamrl.common.errors import WeightSyncError
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import IpcTensor, WeightsBroadcast, WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.service import RolloutService

RENDEZVOUS = WeightsBroadcast(
    store="learner:29600",
    session="s1",
    backend="gloo",
    generation=1,
    block_bytes=4096,
    bucket_bytes=[4096],
    tensors=[IpcTensor("model.norm.weight", "float32", [16], 0, 0)],
)


def _weights(version: int, endpoint: str) -> WeightsPublished:
    return WeightsPublished(
        version=version,
        step=version,
        batch_id="",
        checksum="c",
        num_bytes=64,
        num_buckets=1,
        endpoint=endpoint,
        broadcast=RENDEZVOUS,
    )


class _Engine:
    """Records how each update came; over the broadcast it fails (cannot join) or serves the version."""

    def __init__(self, joins: bool) -> None:
        self.version = 0
        self.joins = joins
        self.calls: list[tuple[str, int]] = []

    async def update_weights(
        self,
        endpoint: str,
        version: int,
        checksum: str,
        timeout_s: float,
        ipc: object = None,
        broadcast: object = None,
        **_: object,
    ) -> None:
        self.calls.append(("broadcast" if broadcast is not None else "zmq", version))
        if broadcast is not None and not self.joins:
            raise WeightSyncError("could not reach the learner's store learner:29600")
        self.version = version


def _run(redis_url: str, run_id: str, engine: _Engine, message: WeightsPublished) -> tuple[int, int, int]:
    """Apply ``message``; returns (version in the served hash, heartbeat version, engine version)."""

    async def scenario() -> tuple[int, int, int]:
        bus, names = Bus(connect(redis_url)), StreamNames(run_id)
        config = RolloutConfig(engine=EngineConfig(model="unused"))
        ctx = ServiceContext("rollout", "rollout-0", config, bus, names, asyncio.Event())  # type: ignore[arg-type]
        service = RolloutService(config, ctx, engine)  # type: ignore[arg-type]
        try:
            await service._apply(message)
            served = await bus.redis.hget(names.served_versions, "rollout-0")
            return int(served), ctx.policy_version, engine.version
        finally:
            await bus.redis.aclose()

    return asyncio.run(asyncio.wait_for(scenario(), timeout=20))


def test_a_member_updates_over_the_broadcast_and_reports_what_it_serves(redis_url: str, run_id: str) -> None:
    engine = _Engine(joins=True)
    assert _run(redis_url, run_id, engine, _weights(3, "")) == (3, 3, 3)
    assert engine.calls == [("broadcast", 3)]


def test_a_worker_that_cannot_join_fetches_over_zmq(redis_url: str, run_id: str) -> None:
    engine = _Engine(joins=False)
    assert _run(redis_url, run_id, engine, _weights(3, "tcp://learner:5555")) == (3, 3, 3)
    assert engine.calls == [("broadcast", 3), ("zmq", 3)]


def test_without_a_zmq_server_the_error_names_the_learner_setting(redis_url: str, run_id: str) -> None:
    engine = _Engine(joins=False)
    with pytest.raises(WeightSyncError, match=r"could not reach .*\(set learner\.weights_zmq_fallback = true"):
        _run(redis_url, run_id, engine, _weights(3, ""))
    assert engine.version == 0
