"""The Redis ACL users of a run with lanes (``redis_acl acl --lanes K``) on a real redis-server started with
their file: each lane service does its job on any lane's keys and touches none of the home's; lane 0's
coordinator joins (the home's ``batches``, its lease, each lane's ``weights`` and ``batches``); the learner reads
and deletes a lane's payloads through its ledger's acknowledgement, as the learner does."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoPermissionError

from streamrl.common.bus import Bus, connect
from streamrl.common.lanes import LaneClients, lane_names
from streamrl.common.streams import StreamNames
from streamrl.learner.rl.ledger import LearnerLedger
from streamrl.ops.redis_acl import acl_file, new_passwords
from streamrl.ops.redis_server import find_redis_server, free_port

RUN = "acllanes"
HOME, LANE0, LANE1 = StreamNames(RUN), lane_names(RUN, 0), lane_names(RUN, 1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, dict[str, str]]]:
    d: Path = tmp_path_factory.mktemp("acl-lanes")
    passwords = new_passwords()
    (d / "users.acl").write_text(acl_file(RUN, passwords, lanes=2))
    port = free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([find_redis_server(), *args, "--aclfile", str(d / "users.acl")], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port, username="observer", password=passwords["observer"]).ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield port, passwords
    finally:
        proc.terminate()
        proc.wait(10)


def login(server: tuple[int, dict[str, str]], user: str) -> redis.Redis:  # type: ignore[type-arg]
    port, passwords = server
    return redis.Redis(port=port, username=user, password=passwords[user])


def test_lane_services_work_in_every_lane_and_never_on_the_home(server: tuple[int, dict[str, str]]) -> None:
    rollout, reward, coordinator = login(server, "rollout"), login(server, "reward"), login(server, "coordinator")
    for lane in (LANE0, LANE1):
        coordinator.xadd(lane.prompts, {"d": "p"})
        rollout.xgroup_create(lane.prompts, "rollout", id="0")
        assert rollout.xreadgroup("rollout", "r0", {lane.prompts: ">"})
        rollout.xadd(lane.trajectories, {"d": "t"})
        reward.xadd(lane.scored, {"d": "s"})
    for client, stream in ((rollout, HOME.trajectories), (reward, HOME.scored), (rollout, HOME.prompts)):
        with pytest.raises(NoPermissionError):
            client.xadd(stream, {"d": "x"})


def test_the_joiner_works_on_the_home_and_every_lane(server: tuple[int, dict[str, str]]) -> None:
    coordinator = login(server, "coordinator")
    assert coordinator.set(HOME.lease("singleton", "joiner"), "me", nx=True, px=5000)
    coordinator.xadd(HOME.batches, {"d": "joined"})
    coordinator.set(HOME.manifest_part("batch-0", "a", 0), b"part")
    for lane in (LANE0, LANE1):
        coordinator.xadd(lane.weights, {"d": "w"})  # the mirror of the home's weights
        coordinator.xadd(lane.batches, {"d": "lane batch"})
        coordinator.xgroup_create(lane.batches, "joiner", id="0")
        ((_, entries),) = coordinator.xreadgroup("joiner", "j", {lane.batches: ">"})
        coordinator.xack(lane.batches, "joiner", entries[0][0])
    with pytest.raises(NoPermissionError):
        coordinator.xadd(HOME.weights, {"d": "w"})  # the home's weights are the learner's


def test_the_learner_deletes_a_lanes_payloads_with_its_ack(server: tuple[int, dict[str, str]]) -> None:
    port, passwords = server
    coordinator = login(server, "coordinator")
    payloads = [LANE0.batched_samples("batch-1", "g0"), LANE1.batched_samples("batch-1", "g1")]
    home_part = HOME.manifest_part("batch-1", "a", 0)
    for key in [*payloads, home_part]:
        coordinator.set(key, b"x")
    coordinator.xadd(HOME.batches, {"d": "joined"})

    async def ack() -> None:
        url = f"redis://learner:{passwords['learner']}@127.0.0.1:{port}/0"
        client = connect(url)
        try:
            await client.xgroup_create(HOME.batches, "learner", id="0")
            ((_, entries),) = await client.xreadgroup("learner", "learner", {HOME.batches: ">"})
            ledger = LearnerLedger(Bus(client, once_scope="learner"), HOME)
            lanes = LaneClients(client, [client, client])
            assert [await client.get(k) for k in payloads] == [b"x", b"x"]  # the learner reads them
            await ledger.ack(HOME.batches, [entries[0][0].decode()], ["batch-1"], 0, 2, [*payloads, home_part], lanes)
        finally:
            await client.aclose()

    asyncio.run(ack())
    observer = login(server, "observer")
    assert [observer.exists(k) for k in [*payloads, home_part]] == [0, 0, 0]  # deleted in both lanes and the home
