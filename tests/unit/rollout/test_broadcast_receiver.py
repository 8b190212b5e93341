"""A rollout engine's member of the learner's weight-broadcast group: deadlines turn into clear errors,
and a version is handed out only as the signed event names it (version and checksum)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcTensor, WeightsBroadcast
from streamrl.torchkit.weights.broadcast import BroadcastPublisher
from streamrl.torchkit.weights.broadcast_member import BroadcastMember, member_for, staging_device


def _rendezvous(store: str, backend: str = "gloo", session: str = "s1") -> WeightsBroadcast:
    return WeightsBroadcast(
        store=store,
        session=session,
        backend=backend,
        generation=0,
        block_bytes=4096,
        bucket_bytes=[4096],
        tensors=[IpcTensor("model.norm.weight", "float32", [16], 0, 0)],
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def publisher() -> Iterator[BroadcastPublisher]:
    pub = BroadcastPublisher(bucket_bytes=4096, timeout_s=10)
    yield pub
    pub.close()


def test_nccl_needs_a_cuda_device() -> None:
    with pytest.raises(WeightSyncError, match="over NCCL, which needs a CUDA device; this engine is on cpu"):
        staging_device("nccl", torch.device("cpu"))
    assert staging_device("gloo", torch.device("cpu")) == torch.device("cpu")


def test_an_unreachable_store_fails_fast_and_stays_failed() -> None:
    store = f"127.0.0.1:{_closed_port()}"
    receiver = BroadcastMember(_rendezvous(store), torch.device("cpu"), "hf", timeout_s=1.0)
    try:
        started = time.perf_counter()
        with pytest.raises(
            WeightSyncError, match=rf"{receiver.member} failed: could not reach the learner's store {store}"
        ):
            receiver.acquire(1, timeout_s=30)
        assert time.perf_counter() - started < 10
        # The same learner again: the failed member answers at once (the caller falls back to ZMQ).
        assert member_for(receiver, _rendezvous(store), torch.device("cpu"), "hf", 1.0) is receiver
        started = time.perf_counter()
        with pytest.raises(WeightSyncError):
            receiver.acquire(1, timeout_s=30)
        assert time.perf_counter() - started < 0.5
    finally:
        receiver.close()


def test_a_version_never_broadcast_misses_its_deadline_naming_the_member(publisher: BroadcastPublisher) -> None:
    published = publisher.publish([("model.norm.weight", torch.ones(16))], version=1)
    info = published["broadcast"]
    receiver = BroadcastMember(info, torch.device("cpu"), "hf", timeout_s=10)
    try:
        assert receiver.acquire(1, timeout_s=10)[0] == 1
        receiver.release()
        started = time.perf_counter()
        pattern = rf"weights version 2 not received over the broadcast group at {info.store} within 0.5 s \(member "
        with pytest.raises(WeightSyncError, match=pattern + rf"{receiver.member}, staged 1\)"):
            receiver.acquire(2, timeout_s=0.5)
        assert 0.5 <= time.perf_counter() - started < 2
    finally:
        receiver.close()


def test_a_new_learner_session_gets_a_new_member(publisher: BroadcastPublisher) -> None:
    published = publisher.publish([("model.norm.weight", torch.ones(16))], version=1)
    info = published["broadcast"]
    first = member_for(None, info, torch.device("cpu"), "hf", 10)
    assert member_for(first, info, torch.device("cpu"), "hf", 10) is first
    assert publisher.wait_delivered(1, timeout_s=10) == [first.member]
    restarted = _rendezvous(f"127.0.0.1:{_closed_port()}", session="s2")
    second = member_for(first, restarted, torch.device("cpu"), "hf", 1.0)
    try:
        assert second is not first and second.info.session == "s2"
        deadline = time.monotonic() + 5
        while publisher.members and time.monotonic() < deadline:  # the first one left the group
            time.sleep(0.05)
        assert publisher.members == []
    finally:
        second.close()


def test_only_the_version_and_checksum_the_signed_event_names_are_handed_out(
    publisher: BroadcastPublisher,
) -> None:
    published = publisher.publish([("model.norm.weight", torch.ones(16))], version=1)
    info, checksum = published["broadcast"], published["checksum"]
    assert info.checksum == checksum  # the rendezvous carries it: signed with the event
    receiver = BroadcastMember(info, torch.device("cpu"), "hf", timeout_s=10)
    try:
        with pytest.raises(WeightSyncError, match=rf"version 1 that hashes to {checksum}, not to {'0' * 64} as the"):
            receiver.acquire(1, timeout_s=10, checksum="0" * 64)  # what the store offers is not what was signed
        version, views = receiver.acquire(1, timeout_s=10, checksum=checksum)
        assert version == 1 and torch.equal(views[0][1], torch.ones(16))
        receiver.release()
        published = publisher.publish([("model.norm.weight", torch.full((16,), 2.0))], version=2)
        checksum_2 = published["checksum"]
        publisher.wait_delivered(2, timeout_s=10)
        with pytest.raises(WeightSyncError, match=r"version 1 was replaced in the staging buffers .* by version 2"):
            receiver.acquire(1, timeout_s=10, checksum=checksum)
        assert receiver.acquire(2, timeout_s=10, checksum=checksum_2)[0] == 2
        receiver.release()
    finally:
        receiver.close()
