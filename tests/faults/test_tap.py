"""The stream tap the fault suite counts from: it keeps every entry written even after the stream is
trimmed, says when it may have missed some, and its slim mode keeps what the counting reads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis as syncredis
from tap import StreamTap, slim

from streamrl.common.codec import decode, encode
from streamrl.common.messages import ScoredTrajectory, Tensor, TrainingBatch, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.ops.redis_server import RedisServer


def _trajectory(i: int) -> Trajectory:
    return Trajectory(
        id=f"p{i}/0",
        group_id=f"p{i}",
        group_index=0,
        group_size=1,
        prompt_ids=Tensor.from_list([1, 2, 3], "int32"),
        response_ids=Tensor.from_list([4] * 50, "int32"),
        logprobs=Tensor.from_list([-0.5] * 50, "float32"),
        loss_mask=Tensor.from_list([1] * 50, "uint8"),
        response_text="x" * 100,
    )


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    srv = RedisServer(tmp_path / "redis", appendonly=False).start()
    yield srv
    srv.stop()


def _wait(ready, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_the_tap_keeps_trimmed_entries_and_says_when_it_missed_some(server: RedisServer) -> None:
    names = StreamNames("tap")
    client = syncredis.Redis(port=server.port)
    client.xadd(names.prompts, {b"d": b"early"})
    client.xadd(names.prompts, {b"d": b"early2"})
    client.xtrim(names.prompts, maxlen=0)  # trimmed before the tap started: it cannot know them
    tap = StreamTap(server.port, names).start()
    try:
        for i in range(50):
            client.xadd(names.trajectories, {b"d": encode(_trajectory(i))})
        _wait(lambda: len(tap.entries(names.trajectories)) == 50)
        client.xtrim(names.trajectories, maxlen=0)
        client.xadd(names.trajectories, {b"d": b"last"})
        tap.stop()
        kept = tap.entries(names.trajectories)
        assert [decode(p).id for _, p in kept[:50]] == [f"p{i}/0" for i in range(50)] and kept[50][1] == b"last"
        assert tap.missed() == ["the tap saw 0 of the 2 entries added to prompts"]
    finally:
        tap.close()


def test_slim_keeps_ids_groups_and_versions() -> None:
    t = _trajectory(7)
    scored = ScoredTrajectory(trajectory=t, reward=1.0)
    batch = TrainingBatch(id="batch-3", index=3, samples=[scored], policy_version=3, staleness=[0])
    for message in (t, scored, batch):
        small = slim(encode(message))
        assert len(small) < 0.6 * len(encode(message))
    out = decode(slim(encode(batch)), TrainingBatch)
    assert (out.id, out.samples[0].trajectory.id, out.samples[0].trajectory.group_id) == ("batch-3", "p7/0", "p7")
    assert slim(b"\xc1junk") == b"\xc1junk"
