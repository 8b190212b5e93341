"""Wire format: every message round-trips; the plain msgpack view has the documented fields."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from streamrl.common.codec import decode, encode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import (
    MESSAGE_TYPES,
    SUPPORTED_VERSIONS,
    BatchManifest,
    DeadLetter,
    Heartbeat,
    LoraAdapter,
    ManifestPart,
    PromptWorkItem,
    SampleRef,
    ScoredRecord,
    ScoredTrajectory,
    Tensor,
    TrainingBatch,
    Trajectory,
    TrajectoryRecord,
    WeightsPublished,
)


def traj() -> Trajectory:
    return Trajectory(
        id="p1/0",
        group_id="p1",
        group_index=0,
        group_size=2,
        prompt_ids=Tensor.from_list([1, 2], "int32"),
        response_ids=Tensor.from_list([3], "int32"),
        logprobs=Tensor.from_list([-0.25], "float32"),
        loss_mask=Tensor.from_list([1], "uint8"),
        traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
    )


SAMPLES = [
    PromptWorkItem(id="p1", prompt_ids=Tensor.from_list([1, 2], "int32"), label="3"),
    traj(),
    ScoredTrajectory(trajectory=traj(), reward=1.0, score=1.0),
    TrajectoryRecord(id="p1/0", group_id="p1", group_index=0, group_size=2, payload_key="k", payload_bytes=300),
    ScoredRecord(
        trajectory=TrajectoryRecord(
            id="p1/0", group_id="p1", group_index=0, group_size=2, payload_key="k", payload_bytes=300
        ),
        reward=1.0,
        turn_rewards=[1.0],
    ),
    TrainingBatch(
        id="batch-0",
        index=0,
        samples=[ScoredTrajectory(trajectory=traj(), reward=0.0)],
        policy_version=0,
        staleness=[0],
    ),
    BatchManifest(
        id="batch-0",
        index=0,
        samples=[
            SampleRef(
                trajectory_id="p1/0",
                group_id="p1",
                key="streamrl:{run}:batched:p1",
                field="p1/0",
                policy_version_start=0,
                num_bytes=300,
            )
        ],
        policy_version=0,
        staleness=[0],
    ),
    ManifestPart(
        batch_id="batch-0",
        number=1,
        samples=[
            SampleRef(
                trajectory_id="p1/1",
                group_id="p1",
                key="streamrl:{run}:batched:batch-0:p1/1",
                field="",
                policy_version_start=0,
                num_bytes=300,
            )
        ],
    ),
    WeightsPublished(
        version=1, step=1, batch_id="batch-0", checksum="ab", num_bytes=1, num_buckets=1, endpoint="tcp://x:1"
    ),
    WeightsPublished(
        version=2,
        step=2,
        batch_id="batch-1",
        checksum="cd",
        num_bytes=7168,
        num_buckets=1,
        endpoint="tcp://x:1",
        payload="lora",
        lora=LoraAdapter(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"]),
    ),
    Heartbeat(service="reward", instance="r-1", pid=1, ts=0.0),
    DeadLetter(
        stream="s", entry_id="1-0", group="g", consumer="c", error="boom", deliveries=3, payload=b"\x00", ts=0.0
    ),
]


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_roundtrip_and_plain_msgpack_view(message: object) -> None:
    data = encode(message)  # type: ignore[arg-type]
    assert decode(data) == message
    plain = msgpack.unpackb(data, raw=False)
    assert isinstance(plain, dict) and plain["type"] in MESSAGE_TYPES
    assert plain["v"] == max(SUPPORTED_VERSIONS[plain["type"]])  # written at the newest version of its type


def test_a_manifests_plain_msgpack_view_names_where_each_payload_lies() -> None:
    (manifest,) = [m for m in SAMPLES if isinstance(m, BatchManifest)]
    plain = msgpack.unpackb(encode(manifest), raw=False)
    assert plain["type"] == "batch_manifest" and plain["id"] == "batch-0"
    (ref,) = plain["samples"]
    assert (ref["key"], ref["field"], ref["num_bytes"]) == ("streamrl:{run}:batched:p1", "p1/0", 300)


def test_tensor_layout_is_documented() -> None:
    t = Tensor.from_numpy(np.array([[1.5, -2.0]], dtype=np.float32))
    plain = msgpack.unpackb(encode(traj()), raw=False)["logprobs"]
    assert set(plain) == {"dtype", "shape", "data"}
    assert t.shape == [1, 2] and t.to_numpy().tolist() == [[1.5, -2.0]]


def test_wrong_expected_type_is_poison_with_a_readable_reason() -> None:
    with pytest.raises(PoisonMessageError) as e:
        decode(encode(traj()), PromptWorkItem)
    assert str(e.value) == "expected a 'prompt' message, got a 'trajectory' message"  # no class reprs
    with pytest.raises(PoisonMessageError) as e:
        decode(encode(traj()), (PromptWorkItem, ScoredTrajectory))
    assert str(e.value) == "expected a 'prompt' or 'scored' message, got a 'trajectory' message"


def test_schema_violation_is_poison_not_crash() -> None:
    plain = msgpack.unpackb(encode(traj()), raw=False)
    plain["group_index"] = "zero"
    with pytest.raises(PoisonMessageError, match="invalid 'trajectory' v1"):
        decode(msgpack.packb(plain))
