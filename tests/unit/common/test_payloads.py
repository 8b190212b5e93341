"""Payload once, references after: what a record keeps, how a sample is assembled, the persist/delete outputs."""

from __future__ import annotations

import numpy as np
import pytest

from streamrl.common.bus import Output
from streamrl.common.codec import decode, encode
from streamrl.common.messages import RECORD_METADATA_BYTES, ScoredRecord, Tensor, Trajectory, TrajectoryRecord
from streamrl.common.payloads import assemble, record_of, small_metadata
from streamrl.common.streams import StreamNames


def _trajectory(tokens: int = 8192, metadata: dict[str, object] | None = None) -> Trajectory:
    mask = np.ones(tokens, dtype=np.uint8)
    mask[:10] = 0
    return Trajectory(
        id="g1/2",
        group_id="g1",
        group_index=2,
        group_size=4,
        prompt_ids=Tensor.from_list([1, 2, 3], "int32"),
        response_ids=Tensor.from_numpy(np.arange(tokens, dtype=np.int32)),
        logprobs=Tensor.from_numpy(np.zeros(tokens, dtype=np.float32)),
        loss_mask=Tensor.from_numpy(mask),
        response_text="x" * tokens,
        truncated=True,
        finish_reason="length",
        policy_version_start=3,
        policy_version_end=4,
        metadata=metadata or {},
        timings={"queue_s": 0.5},
        traceparent="00-abc-def-01",
    )


def test_a_record_is_small_and_carries_what_the_coordinator_decides_by() -> None:
    traj = _trajectory(metadata={"eval_version": 7, "env_info": ["y" * 300] * 20, "subject": "algebra"})
    payload = encode(traj)
    record = record_of(traj, "streamrl:{r}:payload:g1/2:ab", len(payload))
    assert len(encode(record)) < 1024 < len(payload) // 50
    assert (record.id, record.group_id, record.group_index, record.group_size) == ("g1/2", "g1", 2, 4)
    assert (record.policy_version_start, record.policy_version_end, record.truncated) == (3, 4, True)
    assert (record.num_response_tokens, record.num_loss_tokens) == (8192, 8182)
    assert record.payload_bytes == len(payload)
    assert record.metadata == {"eval_version": 7, "subject": "algebra"}  # the big entry stays in the payload
    assert decode(encode(record), TrajectoryRecord) == record


def test_small_metadata_is_kept_whole() -> None:
    metadata = {"a": [1, 2, 3], "b": {"c": "d"}}
    assert small_metadata(metadata) == metadata
    big = {"a": "z" * RECORD_METADATA_BYTES, "n": 1}
    assert small_metadata(big) == {"n": 1}


def test_assemble_gives_the_scored_trajectory_the_learner_trained_before() -> None:
    traj = _trajectory(tokens=16)
    record = record_of(traj, "k", 1)
    record.timings["coordinator/stored_at"] = 12.0
    scored = ScoredRecord(trajectory=record, reward=1.5, score=1.0, turn_rewards=[1.5], extra={"e": 1.0}, scorer="s")
    sample = assemble(scored, traj)
    assert sample.trajectory.response_ids == traj.response_ids and sample.trajectory.logprobs == traj.logprobs
    assert (sample.reward, sample.score, sample.turn_rewards, sample.extra, sample.scorer) == (
        1.5,
        1.0,
        [1.5],
        {"e": 1.0},
        "s",
    )
    assert sample.trajectory.timings["coordinator/stored_at"] == 12.0


def test_assemble_refuses_a_payload_of_another_trajectory() -> None:
    traj = _trajectory(tokens=4)
    scored = ScoredRecord(trajectory=record_of(traj, "k", 1), reward=0.0)
    other = _trajectory(tokens=4)
    other = Trajectory(**{**{f: getattr(other, f) for f in other.__struct_fields__}, "id": "g9/0"})
    with pytest.raises(ValueError, match="holds trajectory g9/0, not g1/2"):
        assemble(scored, other)


def test_payload_keys_keep_the_runs_hash_tag_and_differ_per_attempt() -> None:
    names = StreamNames("run1")
    a, b = names.payload("g1/2", "aa"), names.payload("g1/2", "bb")
    assert a != b and a.startswith(names.payload_prefix) and "{run1}" in a
    assert names.batched_payload("batch-3", "g1/2").startswith(names.batched_samples("batch-3", ""))


def test_persist_and_delete_outputs_name_a_key_and_no_message() -> None:
    Output(key="k", op="persist")
    Output(key="k", op="delete")
    with pytest.raises(AssertionError):
        Output(key="k", op="persist", message=_trajectory(tokens=1))
    with pytest.raises(AssertionError):
        Output(key="k", op="rename")
    Output(key="k", op="expire", ttl_ms=1000)
    with pytest.raises(AssertionError):
        Output(key="k", op="expire")  # an expire needs its time to live
    with pytest.raises(AssertionError):
        Output(key="k", op="delete", ttl_ms=1000)
