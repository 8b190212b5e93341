"""WeightsPublished with CUDA IPC buffers: plain msgpack on the wire, and old messages still decode."""

from __future__ import annotations

import msgpack
import pytest

from streamrl.common.codec import decode, encode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import IpcBuffer, IpcTensor, IpcWeights, WeightsPublished

IPC = IpcWeights(
    device_uuid="5e2f0c1a-7b7d-4f6e-9a0b-0123456789ab",
    block_bytes=4096,
    buffers=[
        IpcBuffer(
            handle=b"\x01" * 64,
            storage_size_bytes=8192,
            storage_offset_bytes=2 * 2**20,
            ref_counter_handle=b"/torch_1234_5678",
            ref_counter_offset=3,
            event_handle=b"\x02" * 64,
            event_sync_required=True,
        )
    ],
    tensors=[
        IpcTensor("model.embed_tokens.weight", "bfloat16", [4, 8], 0, 0),
        IpcTensor("lm_head.weight", "bfloat16", [4, 8], 0, 4096),
    ],
)


def _published(**extra: object) -> WeightsPublished:
    return WeightsPublished(
        version=3, step=3, batch_id="batch-2", checksum="v3:1:2", num_bytes=128, num_buckets=1, endpoint="", **extra
    )  # type: ignore[arg-type]


def test_ipc_weights_round_trip_as_plain_msgpack() -> None:
    message = _published(transport="ipc", ipc=IPC)
    data = encode(message)
    assert decode(data, WeightsPublished) == message
    plain = msgpack.unpackb(data, raw=False)  # no extension types, no pickle
    buffer = plain["ipc"]["buffers"][0]
    assert buffer["handle"] == b"\x01" * 64 and buffer["ref_counter_handle"] == b"/torch_1234_5678"
    assert buffer["event_sync_required"] is True and buffer["storage_offset_bytes"] == 2 * 2**20
    assert plain["ipc"]["tensors"][1] == {
        "name": "lm_head.weight",
        "dtype": "bfloat16",
        "shape": [4, 8],
        "buffer": 0,
        "offset_bytes": 4096,
    }


def test_a_v1_message_without_a_transport_tag_is_refused() -> None:
    old = msgpack.packb(
        {
            "type": "weights",
            "v": 1,
            "version": 1,
            "step": 1,
            "batch_id": "b",
            "checksum": "ab",
            "num_bytes": 1,
            "num_buckets": 1,
            "endpoint": "tcp://learner:5555",
        }
    )
    with pytest.raises(PoisonMessageError, match=r"unsupported version v=1 of 'weights' \(supported: \[4\]\)"):
        decode(old, WeightsPublished)
    assert "ipc" in msgpack.unpackb(encode(_published()), raw=False)  # new writers send ipc: nil
