"""Every CPU-capable weight transport through the one protocol pair: make_publisher -> publish -> the
signed event -> receiver_for(event) -> receive -> the same tensors, checksum verified; a tampered or
unsigned event refused; a transport tag nobody knows refused by name."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import msgspec
import pytest
import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import WeightsBroadcast
from streamrl.common.weights.auth import WeightsAuthError, check, sign
from streamrl.torchkit.testing import weights_event
from streamrl.torchkit.weights.factory import make_publisher, make_receiver, receiver_for
from streamrl.torchkit.weights.protocol import WeightPublisher

KEY = b"k" * 32
RUN = "run"
CPU = torch.device("cpu")
NAMED = [
    ("model.embed_tokens.weight", torch.randn(32, 8).to(torch.bfloat16)),
    ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8)),
    ("model.norm.weight", torch.randn(8)),
]


@pytest.fixture(params=["zmq", "broadcast", "relay"])
def publisher(request: pytest.FixtureRequest) -> Iterator[WeightPublisher]:
    pub = make_publisher(request.param, bucket_bytes=4096, broadcast_timeout_s=10)
    yield pub
    pub.close()


def test_publish_then_receive_gives_the_same_tensors(publisher: WeightPublisher) -> None:
    event = sign(weights_event(1, publisher.publish(NAMED, 1)), KEY, run_id=RUN)
    check(event, KEY, run_id=RUN)
    receiver = receiver_for(event, None, device=CPU, label="test")
    try:
        assert receiver.transport == event.transport
        with receiver.receive(event, timeout_s=20) as received:
            got = {name: t.clone() for name, t in received.tensors}
        assert received.version == 1
        assert set(got) == {name for name, _ in NAMED} | {"lm_head.weight"}  # the tied head, sent explicitly
        for name, tensor in NAMED:
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
        assert torch.equal(got["lm_head.weight"], NAMED[0][1])
        assert receiver_for(event, receiver, device=CPU) is receiver  # kept while the transport stays
    finally:
        receiver.close()


def test_a_tampered_event_is_refused_by_signature_and_by_checksum(publisher: WeightPublisher) -> None:
    event = sign(weights_event(1, publisher.publish(NAMED, 1)), KEY, run_id=RUN)
    forged = "0" * len(event.checksum)
    tampered = msgspec.structs.replace(event, checksum=forged)
    if isinstance(event.broadcast, WeightsBroadcast):  # members check the rendezvous' checksum
        tampered = msgspec.structs.replace(
            tampered, broadcast=msgspec.structs.replace(event.broadcast, checksum=forged)
        )
    with pytest.raises(WeightsAuthError):
        check(tampered, KEY, run_id=RUN)
    with pytest.raises(WeightsAuthError):
        check(msgspec.structs.replace(event, transport="ipc"), KEY, run_id=RUN)  # the tag is signed too
    with pytest.raises(WeightsAuthError):
        check(msgspec.structs.replace(event, signature=""), KEY, run_id=RUN)  # unsigned
    receiver = receiver_for(tampered, None, device=CPU, label="test")
    try:
        with pytest.raises(WeightSyncError, match=r"(checksum|hashes to)"), receiver.receive(tampered, timeout_s=20):
            pass
    finally:
        receiver.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_broadcast_receiver_that_cannot_join_falls_back_to_zmq_only_where_served() -> None:
    publisher = make_publisher("broadcast", bucket_bytes=4096, broadcast_timeout_s=10, zmq_fallback=True)
    try:
        fields = publisher.publish(NAMED, 1)
        assert fields["transport"] == "broadcast" and fields["endpoint"].startswith("tcp://")
        assert fields["broadcast"] is not None
        unreachable = msgspec.structs.replace(fields["broadcast"], store=f"127.0.0.1:{_closed_port()}")
        event = weights_event(1, fields, broadcast=unreachable)
        receiver = make_receiver("broadcast", device=CPU, label="test")
        try:
            with receiver.receive(event, timeout_s=5) as received:
                assert dict(received.tensors)["model.norm.weight"].equal(NAMED[2][1])
            alone = msgspec.structs.replace(event, endpoint="")
            with pytest.raises(WeightSyncError, match=r"set learner\.weights_zmq_fallback"), receiver.receive(alone, 5):
                pass
        finally:
            receiver.close()
    finally:
        publisher.close()


def test_a_lora_payload_never_travels_the_broadcast_group() -> None:
    event = weights_event(
        1, transport="broadcast", payload="lora", broadcast=WeightsBroadcast("h:1", "s", "gloo", 0, 4096, [], [])
    )
    receiver = make_receiver("broadcast", device=CPU)
    with pytest.raises(WeightSyncError, match="LoRA adapter never travels"), receiver.receive(event, 1):
        pass


def test_an_ipc_receiver_refuses_a_cpu_engine_naming_the_setting() -> None:
    with pytest.raises(WeightSyncError, match=r"need a CUDA device.*set learner\.weights_transport = 'zmq'"):
        make_receiver("ipc", device=CPU)


def test_the_factories_refuse_an_unknown_transport_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown weights transport 'rdma' \(known: zmq, ipc, broadcast, relay\)"):
        make_publisher("rdma")
    with pytest.raises(ValueError, match=r"unknown weights transport 'rdma' \(known: zmq, ipc, broadcast, relay\)"):
        make_receiver("rdma", device=CPU)
    event = weights_event(1)
    with pytest.raises(ValueError, match="unknown weights transport 'rdma'"):
        receiver_for(msgspec.structs.replace(event, transport="rdma"), None, device=CPU)  # type: ignore[arg-type]
