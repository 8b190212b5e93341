"""Per-token policy versions: the run-length form engines record and trajectories carry."""

from __future__ import annotations

import msgpack
import pytest

from streamrl.common.codec import decode, encode
from streamrl.common.messages import Tensor, Trajectory
from streamrl.rollout.engines.engine import Sample, token_versions, turn_versions, version_runs


@pytest.mark.parametrize(
    ("switches", "num_tokens", "runs"),
    [
        ([(0, 3)], 10, []),  # one version: nothing to record
        ([], 0, []),
        ([(0, 3), (4, 4)], 10, [(0, 3), (4, 4)]),
        ([(0, 3), (4, 4)], 4, []),  # the switch came after the last token (a stop string cut it, or it ended)
        ([(0, 3), (4, 3)], 10, []),  # no change of version
        ([(0, 3), (4, 4), (4, 5)], 10, [(0, 3), (4, 5)]),  # two updates between two tokens: the later one
        ([(0, 3), (4, 4), (4, 3)], 10, []),  # ... back to the first
        ([(0, 3), (2, 4), (7, 5)], 8, [(0, 3), (2, 4), (7, 5)]),
    ],
)
def test_version_runs(switches: list[tuple[int, int]], num_tokens: int, runs: list[tuple[int, int]]) -> None:
    assert version_runs(switches, num_tokens) == runs


def test_token_versions_expands_the_runs() -> None:
    assert token_versions([], 3, 4) == [3, 3, 3, 3]
    assert token_versions([(0, 3), (2, 4), (3, 6)], 3, 5) == [3, 3, 4, 6, 6]


def _sample(n: int, start: int, versions: list[tuple[int, int]] | None = None) -> Sample:
    end = versions[-1][1] if versions else start
    return Sample([1] * n, [-0.1] * n, "x", "stop", start, end, versions=versions or [])


def test_turn_versions_shift_each_turn_to_where_it_starts() -> None:
    # turn 1 tokens 0-3 (version 2), environment 4-5, turn 2 tokens 6-10 (2, then 3 from its token 2)
    turns = [(0, _sample(4, 2)), (6, _sample(5, 2, [(0, 2), (2, 3)]))]
    assert turn_versions(turns, 11) == [(0, 2), (8, 3)]
    assert token_versions(turn_versions(turns, 11), 2, 11) == [2] * 8 + [3] * 3
    assert turn_versions([(0, _sample(4, 2)), (6, _sample(5, 2))], 11) == []
    assert turn_versions([(0, _sample(4, 2)), (6, _sample(5, 3))], 11) == [(0, 2), (6, 3)]


def _trajectory(**fields: object) -> Trajectory:
    return Trajectory(
        id="p1/0",
        group_id="p1",
        group_index=0,
        group_size=1,
        prompt_ids=Tensor.from_list([1, 2], "int32"),
        response_ids=Tensor.from_list([3, 4, 5], "int32"),
        logprobs=Tensor.from_list([-0.25] * 3, "float32"),
        loss_mask=Tensor.from_list([1] * 3, "uint8"),
        **fields,  # type: ignore[arg-type]
    )


def test_trajectory_carries_the_runs_and_older_messages_still_decode() -> None:
    partial = _trajectory(policy_version_start=3, policy_version_end=4, policy_versions=[(0, 3), (2, 4)])
    assert decode(encode(partial), Trajectory).policy_versions == [(0, 3), (2, 4)]
    older = msgpack.unpackb(encode(_trajectory()), raw=False)  # as a producer without the field wrote it
    older.pop("policy_versions", None)
    decoded = decode(msgpack.packb(older, use_bin_type=True), Trajectory)
    assert decoded.policy_versions == []
