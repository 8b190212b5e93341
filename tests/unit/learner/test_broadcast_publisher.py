"""The learner's weight-broadcast publisher on gloo, with receivers as threads of this process.

Buckets and checksum are the CUDA IPC path's (tested in test_ipc_publisher.py); here: what a
receiver rebuilds from the advertised layout, the deadline that turns a member that never comes
into a named drop, and a member that leaves on purpose costing no deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import torch

from streamrl.common.weights import broadcast as wb
from streamrl.torchkit.weights.broadcast import BroadcastPublisher
from streamrl.torchkit.weights.broadcast_member import BroadcastMember
from streamrl.torchkit.weights.factory import make_publisher
from streamrl.torchkit.weights.ipc import BLOCK_BYTES, tensor_views, weights_checksum


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(50, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(64, 16, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(16, generator=g)),
    ]


@pytest.fixture
def publisher(request: pytest.FixtureRequest) -> Iterator[BroadcastPublisher]:
    timeout_s = getattr(request, "param", 30.0)
    pub = BroadcastPublisher(bucket_bytes=2 * BLOCK_BYTES, timeout_s=timeout_s)
    yield pub
    pub.close()


def test_the_advertised_layout_rebuilds_the_tensors_and_the_checksum(publisher: BroadcastPublisher) -> None:
    named = _weights(0)
    published = publisher.publish(named, version=1)
    info, checksum = published["broadcast"], published["checksum"]
    assert info.backend == "gloo" and info.store == publisher.address and info.block_bytes == BLOCK_BYTES
    assert len(info.bucket_bytes) == publisher.num_buckets > 1
    assert [t.name for t in info.tensors] == [n for n, _ in named] + ["lm_head.weight"]
    # What a receiver does: buckets of the advertised sizes, tensors where the layout says.
    buckets = [torch.zeros(n, dtype=torch.uint8) for n in info.bucket_bytes]
    expected = {**dict(named), "lm_head.weight": named[0][1]}
    for t, view in zip(info.tensors, tensor_views(buckets, info.tensors), strict=True):
        view.copy_(expected[t.name])
    assert weights_checksum(buckets, 1) == checksum
    assert all(torch.equal(tensor, expected[name]) for name, tensor in publisher.tensors())
    published = publisher.publish(_weights(1), version=2)
    info_2, checksum_2 = published["broadcast"], published["checksum"]
    assert checksum_2 != checksum and info_2.tensors == info.tensors and info_2.session == info.session
    with pytest.raises(ValueError, match="version must increase"):
        publisher.publish(_weights(1), version=2)


def test_without_members_publish_returns_at_once(publisher: BroadcastPublisher) -> None:
    started = time.perf_counter()
    for version in range(1, 4):
        publisher.publish(_weights(version), version)
    assert time.perf_counter() - started < 1.0
    with pytest.raises(TimeoutError, match=r"version 3 not delivered to 1 members within 0.2 s .*members \[\]"):
        publisher.wait_delivered(3, timeout_s=0.2)


@pytest.mark.parametrize("publisher", [0.5], indirect=True)
def test_a_member_that_never_comes_is_named_dropped_and_the_others_served(
    publisher: BroadcastPublisher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="streamrl.torchkit.weights.broadcast")
    published = publisher.publish(_weights(0), version=1)
    info = published["broadcast"]
    ghost = torch.distributed.TCPStore("127.0.0.1", int(info.store.rsplit(":", 1)[1]), is_master=False)
    ghost.set(wb.join_key(ghost.add(wb.JOINS, 1)), "ghost:1:hf:00")  # registers, never comes
    receiver = BroadcastMember(info, torch.device("cpu"), "hf", timeout_s=10)
    try:
        started = time.perf_counter()
        version, _ = receiver.acquire(1, timeout_s=10)
        receiver.release()
        assert version == 1 and receiver.staged_version == 1
        assert publisher.wait_delivered(1, timeout_s=5) == [receiver.member]
        assert time.perf_counter() - started < 5
        assert "dropped from generation" in caplog.text and "ghost:1:hf:00 (no answer in 0.5 s)" in caplog.text
    finally:
        receiver.close()


def test_a_member_that_leaves_costs_no_deadline(publisher: BroadcastPublisher) -> None:
    published = publisher.publish(_weights(0), version=1)
    info = published["broadcast"]
    staying, leaving = (BroadcastMember(info, torch.device("cpu"), label, timeout_s=10) for label in ("a", "b"))
    try:
        assert set(publisher.wait_delivered(1, timeout_s=10, min_members=2)) == {staying.member, leaving.member}
        leaving.close()
        started = time.perf_counter()
        publisher.publish(_weights(1), version=2)
        assert publisher.wait_delivered(2, timeout_s=10) == [staying.member]
        assert time.perf_counter() - started < 5  # the deadline is 30 s
        timing = publisher.last_delivery
        assert (timing["version"], timing["members"]) == (2, 1)
        assert (
            0
            < timing["buckets_s"]
            <= timing["total_s"]
            == pytest.approx(timing["ready_s"] + timing["buckets_s"] + timing["acks_s"])
        )
        assert staying.acquire(2, timeout_s=5)[0] == 2
        staying.release()
    finally:
        staying.close()


def test_the_factory_advertises_the_weights_host() -> None:
    pub = make_publisher("broadcast", advertise_host="learner-0", bucket_bytes=2 * 2**20, broadcast_timeout_s=5)
    try:
        assert isinstance(pub, BroadcastPublisher)
        assert pub.address.startswith("learner-0:") and int(pub.address.rsplit(":", 1)[1]) > 0
    finally:
        pub.close()
