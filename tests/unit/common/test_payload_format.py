"""Payload format 2 (:mod:`streamrl.common.payload_format`): ``[2, head, tensors]``, the head what text scorers read,
the whole what the learner reads; format 1 (the encoded Trajectory alone) still read."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from streamrl.common.codec import encode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import Image, SamplingParams, Tensor, Trajectory, Turn
from streamrl.common.payload_format import PAYLOAD_FORMAT, pack_payload, unpack_head, unpack_payload
from streamrl.common.payloads import record_of


def _trajectory(tokens: int = 8192) -> Trajectory:
    rng = np.random.default_rng(0)
    mask = np.ones(tokens, dtype=np.uint8)
    mask[100:200] = 0
    return Trajectory(
        id="g1/2",
        group_id="g1",
        group_index=2,
        group_size=4,
        prompt_ids=Tensor.from_list(list(range(64)), "int32"),
        response_ids=Tensor.from_numpy(rng.integers(0, 150_000, tokens, dtype=np.int32)),
        logprobs=Tensor.from_numpy(rng.standard_normal(tokens).astype(np.float32)),
        loss_mask=Tensor.from_numpy(mask),
        prompt_text="What is 2+2?",
        response_text="It is 4. " * 100,
        finish_reason="length",
        truncated=True,
        sampling=SamplingParams(temperature=0.7),
        policy_version_start=3,
        policy_version_end=4,
        policy_versions=[(0, 3), (50, 4)],
        label="4",
        metadata={"messages": [{"role": "user", "content": "hi"}], "subject": "arithmetic"},
        images=[Image(media_type="image/png", data=b"\x89PNG" + b"\x00" * 1000)],
        timings={"queue_s": 0.5},
        traceparent="00-abc-def-01",
        turns=[Turn(start=0, end=100, policy_version=3, reward=0.5), Turn(start=200, end=tokens, policy_version=4)],
        stop_reason="</s>",
    )


def test_a_payload_round_trips_every_field_of_the_trajectory() -> None:
    traj = _trajectory()
    payload, head_bytes = pack_payload(traj)
    assert unpack_payload(payload) == traj
    assert 0 < head_bytes < len(payload)


def test_the_head_holds_every_field_but_the_tensors_and_images() -> None:
    traj = _trajectory()
    payload, head_bytes = pack_payload(traj)
    head = unpack_head(payload[:head_bytes])
    empty = {"prompt_ids", "response_ids", "logprobs", "loss_mask"}
    for field in traj.__struct_fields__:
        if field in empty:
            assert len(getattr(head, field).to_numpy()) == 0, field
        elif field == "images":
            assert head.images == []
        else:
            assert getattr(head, field) == getattr(traj, field), field
    # what scorers read is a few KB of an 8k-token trajectory's ~75 KB
    assert head_bytes < len(payload) / 10


def test_a_payload_is_plain_msgpack_an_array_of_format_head_and_tensors() -> None:
    payload, _ = pack_payload(_trajectory(tokens=16))
    fmt, head, tensors = msgspec.msgpack.decode(payload)  # any msgpack library reads it
    assert fmt == PAYLOAD_FORMAT == 2
    assert head["type"] == "trajectory" and head["response_text"] == "It is 4. " * 100
    assert sorted(tensors) == ["images", "logprobs", "loss_mask", "prompt_ids", "response_ids"]
    assert tensors["response_ids"]["shape"] == [16]


def test_a_payload_of_format_1_the_trajectory_alone_is_still_read_whole() -> None:
    traj = _trajectory(tokens=32)
    assert unpack_payload(encode(traj)) == traj
    assert record_of(traj, "k", 10).payload_head_bytes == 0, "a record without a head length: read whole"
    with pytest.raises(PoisonMessageError, match="a payload head must start with 9302"):
        unpack_head(encode(traj))


def test_an_unknown_payload_format_or_a_broken_payload_is_refused_naming_it() -> None:
    payload, head_bytes = pack_payload(_trajectory(tokens=16))
    with pytest.raises(PoisonMessageError, match=r"payload format 03 .* not supported"):
        unpack_payload(b"\x93\x03" + payload[2:])
    with pytest.raises(PoisonMessageError, match="invalid payload"):
        unpack_payload(payload[: head_bytes + 5])
    with pytest.raises(PoisonMessageError, match="undecodable"):
        unpack_payload(b"\x01\x02")


def test_the_record_carries_the_head_length() -> None:
    traj = _trajectory(tokens=16)
    payload, head_bytes = pack_payload(traj)
    record = record_of(traj, "k", len(payload), head_bytes)
    assert (record.payload_bytes, record.payload_head_bytes) == (len(payload), head_bytes)
