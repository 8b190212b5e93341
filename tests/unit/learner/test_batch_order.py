"""The learner's rules for what reaches it (streamrl.learner.rl.batch_order), on plain values."""

from __future__ import annotations

import msgspec
import numpy as np

from streamrl.common.messages import (
    BatchManifest,
    SampleRef,
    SamplingParams,
    ScoredTrajectory,
    Tensor,
    TrainingBatch,
    Trajectory,
)
from streamrl.learner.rl.batch_order import LOST, Attempts, Gap, behind_verdict, fingerprint, gap_verdict


def batch(index: int, ids: tuple[str, ...] = ("a", "b"), name: str | None = None) -> TrainingBatch:
    one = Tensor.from_numpy(np.ones(1, dtype=np.int32))
    zero = Tensor.from_numpy(np.zeros(1, dtype=np.float32))
    mask = Tensor.from_numpy(np.ones(1, dtype=np.uint8))
    sampling = SamplingParams(temperature=1.0)
    trajectories = [
        Trajectory(
            id=i,
            group_id="g",
            group_index=k,
            group_size=len(ids),
            prompt_ids=one,
            response_ids=one,
            logprobs=zero,
            loss_mask=mask,
            sampling=sampling,
        )
        for k, i in enumerate(ids)
    ]
    samples = [ScoredTrajectory(trajectory=t, reward=0.0) for t in trajectories]
    return TrainingBatch(
        id=name or f"batch-{index}", index=index, samples=samples, policy_version=0, staleness=[0] * len(ids)
    )


def test_a_copy_has_the_same_fingerprint_and_other_content_does_not() -> None:
    assert fingerprint(batch(3)) == fingerprint(batch(3))
    assert fingerprint(batch(3)) != fingerprint(batch(3, ids=("a", "c")))
    assert fingerprint(batch(3)) != fingerprint(batch(3, name="batch-3b"))


def test_behind_a_copy_is_skipped_and_anything_else_is_refused_naming_both() -> None:
    assert behind_verdict(batch(1), 4, fingerprint(batch(1))) is None
    error = behind_verdict(batch(1, ids=("x",), name="batch-1x"), 4, fingerprint(batch(1)))
    assert error is not None and "batch-1x has index 1, which the learner already consumed as batch-1" in error
    lost = behind_verdict(batch(1), 4, LOST)
    assert lost is not None and "recorded as lost" in lost
    unknown = behind_verdict(batch(1), 4, None)
    assert unknown is not None and "acknowledged long ago" in unknown


def test_a_gap_is_confirmed_only_when_no_missing_index_is_still_to_come() -> None:
    assert gap_verdict(batch(5), 2, {5: "9-0", 7: "11-0"}, published=8) == Gap(lost=[2, 3, 4])
    # a missing index still in the stream (its delivery's reply lost, or re-sent): the earliest one trains first
    assert gap_verdict(batch(5), 2, {4: "8-0", 3: "7-0"}, published=8) == Gap(first=(3, "7-0"))
    assert gap_verdict(batch(5), 2, {2: "6-0"}, published=5) == Gap(first=(2, "6-0"))  # even when not published past


def test_a_batch_the_coordinator_has_not_reached_is_from_the_future() -> None:
    """A forged batch far ahead: its predecessors are still to be written, none is recorded as lost."""
    gap = gap_verdict(batch(503), 2, {}, published=6)
    assert gap.lost == [] and gap.first is None and gap.error is not None and "a batch from the future" in gap.error


def test_attempts_count_kills_as_steps_started_that_never_returned() -> None:
    assert not Attempts(started=1, finished=1).exhausted(1)
    killed = Attempts(started=2, finished=0)
    assert killed.kills == 2 and killed.exhausted(2)
    assert killed.reason().startswith("it killed its consumer 2 times")
    failed = Attempts(started=2, finished=2, failed=2, error="ValueError: bad")
    assert failed.exhausted(2) and failed.reason() == "its step failed 2 times, last: ValueError: bad"
    both = Attempts(started=2, finished=1, failed=1, error="E")
    assert both.exhausted(2) and "failed 1 times, last: E; and it killed its consumer 1 times" in both.reason()


def test_a_split_manifest_is_fingerprinted_by_its_parts_read_or_not() -> None:
    whole = batch(3, ids=("a", "b", "c"))
    header = BatchManifest(
        id=whole.id, index=3, samples=[], policy_version=0, staleness=[0, 0, 0], parts=["k:a1:0", "k:a1:1"]
    )
    ref = SampleRef(trajectory_id="a", group_id="g", key="k", field="", policy_version_start=0, num_bytes=1)
    read = msgspec.structs.replace(header, samples=[ref, ref, ref])
    rebuilt = msgspec.structs.replace(header, parts=["k:b2:0", "k:b2:1"])  # the same index built by another attempt
    assert fingerprint(header) == fingerprint(read) and fingerprint(header).startswith("batch-3 3 ")
    assert fingerprint(rebuilt) != fingerprint(header)
    assert behind_verdict(read, 4, fingerprint(header)) is None
