"""The joiner's pure rules: which lane entries it joins, how K lane batches become one, each lane's share."""

from __future__ import annotations

import msgspec
from coordinator_fakes import sample

from streamrl.common.codec import encode
from streamrl.common.lanes import lane_names
from streamrl.common.messages import BatchManifest, SampleRef, WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.coordinator.joining import after, join_manifests, lane_entry_problem, lane_share
from streamrl.coordinator.mirror import Mirrored


def manifest(names: StreamNames, index: int, groups: list[str], staleness: int = 0) -> BatchManifest:
    batch_id = f"batch-{index}"
    refs = [
        SampleRef(
            trajectory_id=f"{g}/0",
            group_id=g,
            key=names.batched_payload(batch_id, f"{g}/0"),
            field="",
            policy_version_start=0,
            num_bytes=1,
            scored=sample(g, 0),
        )
        for g in groups
    ]
    return BatchManifest(
        id=batch_id, index=index, samples=refs, policy_version=index, staleness=[staleness] * len(refs)
    )


def test_a_joined_batch_is_the_lanes_samples_in_lane_order_at_the_newest_version() -> None:
    lanes = [lane_names("r", 0), lane_names("r", 1)]
    a = manifest(lanes[0], 3, ["p0", "p2"], staleness=1)
    b = manifest(lanes[1], 3, ["p1"], staleness=0)
    b = msgspec.structs.replace(b, policy_version=5)
    joined = join_manifests(3, [a, b], created_at=7.0)
    assert (joined.id, joined.index, joined.policy_version, joined.created_at) == ("batch-3", 3, 5, 7.0)
    assert [s.group_id for s in joined.samples] == ["p0", "p2", "p1"]
    assert joined.staleness == [1, 1, 0]
    assert [s.group_id for s in lane_share(joined, lanes[1]).samples] == ["p1"]
    assert lane_share(joined, lanes[0]).staleness == [1, 1]


def test_only_a_lanes_next_batch_of_its_own_keys_is_joined() -> None:
    lane = lane_names("r", 1)
    assert lane_entry_problem(manifest(lane, 0, ["p1"]), 1, lane, -1) is None
    assert "taken already" in str(lane_entry_problem(manifest(lane, 0, ["p1"]), 1, lane, 0))
    assert "skips to 2" in str(lane_entry_problem(manifest(lane, 2, ["p1"]), 1, lane, 0))
    foreign = manifest(lane_names("other", 1), 0, ["p1"])
    assert "another run or lane" in str(lane_entry_problem(foreign, 1, lane, -1))
    assert "another run or lane" in str(lane_entry_problem(manifest(lane_names("r", 0), 0, ["p0"]), 1, lane, -1))


def test_entry_ids_compare_as_stream_ids() -> None:
    assert after("10-0", "9-5") and after("1-0", "") and not after("9-5", "9-5") and not after("9-4", "9-5")


def test_the_run_ends_only_once_every_lane_has_the_last_version() -> None:
    """Lane 0's coordinator ends the run on ``Mirrored.everywhere()``: the newest version every lane holds."""
    mirrored = Mirrored([-1, -1, -1])
    event = WeightsPublished(version=8, step=8, batch_id="", checksum="0", num_bytes=0, num_buckets=0, endpoint="")
    mirrored.saw(0, encode(event))
    mirrored.saw(2, encode(event))
    assert mirrored.everywhere() == -1  # lane 1 (its Redis down, say) has none yet
    mirrored.saw(1, b"not a message")  # an undecodable entry moves nothing
    assert mirrored.everywhere() == -1
    mirrored.saw(1, encode(msgspec.structs.replace(event, version=7)))
    assert mirrored.everywhere() == 7
    mirrored.saw(1, encode(event))
    assert mirrored.everywhere() == 8 and mirrored.versions == [8, 8, 8]
