"""CUDA IPC weight sync between two processes on one GPU (skipped without CUDA).

A spawned process plays the learner: it publishes with ``IpcPublisher`` and sends the
``WeightsPublished`` message through a pipe as the msgpack bytes the bus would carry. The test
process plays the engine: ``IpcReceiver`` fetches, and the tensors must equal the published ones.
One learner keeps one buffer set (every version rewrites it), another two (written in turn).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from multiprocessing.connection import Connection

import msgspec
import pytest
import torch

from streamrl.common.codec import decode, encode
from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import WeightsPublished
from streamrl.torchkit.weights.ipc import IpcPublisher, IpcReceiver

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BUCKET_BYTES = 2**20
OPENED = "opened a CUDA IPC weight buffer"


def _weights(seed: int, device: str) -> list[tuple[str, torch.Tensor]]:
    """A small tied-embedding model's tensors (~2.5 MB: several 1 MiB buffers), bf16 and fp32."""
    g = torch.Generator().manual_seed(seed)
    named = [("model.embed_tokens.weight", torch.randn(1000, 256, generator=g).to(torch.bfloat16))]
    for i in range(2):
        named += [
            (f"model.layers.{i}.self_attn.q_proj.weight", torch.randn(256, 256, generator=g).to(torch.bfloat16)),
            (f"model.layers.{i}.self_attn.q_proj.bias", torch.randn(256, generator=g).to(torch.bfloat16)),
            (f"model.layers.{i}.mlp.up_proj.weight", torch.randn(512, 256, generator=g).to(torch.bfloat16)),
            (f"model.layers.{i}.input_layernorm.weight", torch.randn(256, generator=g)),
        ]
    named.append(("model.norm.weight", torch.randn(256, generator=g)))
    return [(name, t.to(device)) for name, t in named]


def _expected(seed: int) -> dict[str, torch.Tensor]:
    named = dict(_weights(seed, "cpu"))
    return {**named, "lm_head.weight": named["model.embed_tokens.weight"]}


def _learner(conn: Connection, num_sets: int) -> None:
    """The learner process: ("publish", version) -> WeightsPublished bytes; ("corrupt", _) flips a bit."""
    publisher = IpcPublisher(bucket_bytes=BUCKET_BYTES, num_sets=num_sets)
    while True:
        command, version = conn.recv()
        if command == "stop":
            return
        if command == "publish":
            published = publisher.publish(_weights(version, "cuda"), version)
            ipc, checksum = published["ipc"], published["checksum"]
            message = WeightsPublished(
                version=version,
                step=version,
                batch_id="",
                checksum=checksum,
                num_bytes=publisher.num_bytes,
                num_buckets=publisher.num_buffers,
                endpoint="",
                transport="ipc",
                ipc=ipc,
            )
            conn.send_bytes(encode(message))
        elif command == "corrupt":  # a corrupted buffer, not a new version
            publisher._buffers[0][100] ^= 1
            torch.cuda.synchronize()
            conn.send_bytes(b"")


def _spawn_learner(num_sets: int) -> Iterator[Connection]:
    ctx = torch.multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_learner, args=(child, num_sets), daemon=True)
    proc.start()
    child.close()  # a dead learner is then an EOFError here, not a hang
    yield conn
    conn.send(("stop", 0))
    proc.join(timeout=30)


@pytest.fixture(scope="module")
def learner() -> Iterator[Connection]:
    """A learner with one buffer set (every version rewrites the same buffers)."""
    yield from _spawn_learner(1)


@pytest.fixture(scope="module")
def learner_two_sets() -> Iterator[Connection]:
    yield from _spawn_learner(2)


@pytest.fixture(scope="module")
def receiver(learner: Connection) -> IpcReceiver:
    """Torn down before the learner: it releases the learner's buffers while the learner lives."""
    return IpcReceiver(torch.device("cuda", 0))


def _publish(learner: Connection, version: int) -> WeightsPublished:
    learner.send(("publish", version))
    return decode(learner.recv_bytes(), WeightsPublished)


def _assert_equal(fetched: list[tuple[str, torch.Tensor]], seed: int) -> None:
    expected = _expected(seed)
    assert [name for name, _ in fetched] == list(expected)
    for name, tensor in fetched:
        assert tensor.device.type == "cuda" and torch.equal(tensor.cpu(), expected[name]), name


def test_fetch_returns_the_published_weights(
    learner: Connection, receiver: IpcReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    msg = _publish(learner, 1)
    assert msg.ipc is not None and len(msg.ipc.buffers) >= 3
    with caplog.at_level(logging.INFO, logger="streamrl.torchkit.weights.ipc"):
        _assert_equal(receiver.fetch(msg.ipc, msg.version, msg.checksum), seed=1)
    assert sum(OPENED in r.getMessage() for r in caplog.records) == len(msg.ipc.buffers)


def test_the_next_version_reuses_the_open_handles(
    learner: Connection, receiver: IpcReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    msg = _publish(learner, 2)
    assert msg.ipc is not None
    with caplog.at_level(logging.INFO, logger="streamrl.torchkit.weights.ipc"):
        _assert_equal(receiver.fetch(msg.ipc, msg.version, msg.checksum), seed=2)
    assert not any(OPENED in r.getMessage() for r in caplog.records)


def test_a_version_overwritten_before_the_fetch_is_refused_before_the_copy(
    learner: Connection, receiver: IpcReceiver
) -> None:
    old, new = _publish(learner, 3), _publish(learner, 4)
    assert old.ipc is not None and new.ipc is not None
    with pytest.raises(WeightSyncError, match=r"version 3 superseded: .* set 0 holds version 4 now"):
        receiver.fetch(old.ipc, old.version, old.checksum)
    _assert_equal(receiver.fetch(new.ipc, new.version, new.checksum), seed=4)


def test_a_corrupted_buffer_raises(learner: Connection, receiver: IpcReceiver) -> None:
    msg = _publish(learner, 5)
    assert msg.ipc is not None
    learner.send(("corrupt", 0))
    learner.recv_bytes()
    with pytest.raises(WeightSyncError, match="checksum mismatch for version 5"):
        receiver.fetch(msg.ipc, msg.version, msg.checksum)


def test_an_engine_on_another_gpu_is_told_to_use_zmq(learner: Connection, receiver: IpcReceiver) -> None:
    msg = _publish(learner, 6)
    assert msg.ipc is not None
    elsewhere = msgspec.structs.replace(msg.ipc, device_uuid="00000000-0000-0000-0000-000000000000")
    with pytest.raises(WeightSyncError, match=r"not on the learner's GPU.*weights_transport = 'zmq'"):
        receiver.fetch(elsewhere, msg.version, msg.checksum)


def test_two_sets_keep_the_previous_version_readable_and_open_each_handle_once(
    learner_two_sets: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = IpcReceiver(torch.device("cuda", 0))
    try:
        first, second = _publish(learner_two_sets, 1), _publish(learner_two_sets, 2)
        assert first.ipc is not None and second.ipc is not None
        assert (first.ipc.buffer_set, second.ipc.buffer_set, second.ipc.num_sets) == (0, 1, 2)
        assert first.ipc.reader_lock != second.ipc.reader_lock
        with caplog.at_level(logging.INFO, logger="streamrl.torchkit.weights.ipc"):
            _assert_equal(receiver.fetch(first.ipc, 1, first.checksum), seed=1)  # written over by neither
            _assert_equal(receiver.fetch(second.ipc, 2, second.checksum), seed=2)
        opened = sum(OPENED in r.getMessage() for r in caplog.records)
        assert opened == len(first.ipc.buffers) + len(second.ipc.buffers)  # each set's handles, once
        caplog.clear()
        third = _publish(learner_two_sets, 3)  # set 0 again
        assert third.ipc is not None and third.ipc.buffer_set == 0
        with pytest.raises(WeightSyncError, match=r"version 1 superseded: .* set 0 holds version 3 now"):
            receiver.fetch(first.ipc, 1, first.checksum)
        with caplog.at_level(logging.INFO, logger="streamrl.torchkit.weights.ipc"):
            _assert_equal(receiver.fetch(second.ipc, 2, second.checksum), seed=2)  # still intact
            _assert_equal(receiver.fetch(third.ipc, 3, third.checksum), seed=3)
        assert not any(OPENED in r.getMessage() for r in caplog.records)
    finally:
        receiver.close()
