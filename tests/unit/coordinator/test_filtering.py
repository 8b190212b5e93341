"""DAPO dynamic filtering: spread rule, mean range, counts, order (its import without torch: tests/integration)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.coordinator.filtering import filter_groups, has_spread


def test_binary_groups_follow_dapo_rule() -> None:
    groups = {"all_wrong": [0, 0, 0, 0], "mixed": [0, 1, 0, 0], "all_right": [1, 1, 1, 1], "half": [1, 0, 1, 0]}
    result = filter_groups(groups.items(), lambda item: item[1])
    assert [name for name, _ in result.kept] == ["mixed", "half"]
    assert [name for name, _ in result.dropped] == ["all_wrong", "all_right"]
    assert (result.num_kept, result.num_dropped, result.num_all_equal, result.num_out_of_range) == (2, 2, 2, 0)


def test_non_binary_scores_and_min_spread() -> None:
    groups = [[0.3, 0.3, 0.3], [0.3, 0.3000001, 0.3], [0.1, 0.7, 0.4]]
    assert filter_groups(groups, lambda g: g).kept == groups[1:]
    assert filter_groups(groups, lambda g: g, min_spread=1e-3).kept == groups[2:]


def test_mean_range_is_strict() -> None:
    groups = [[0.0, 1.0], [0.0, 0.5], [2.0, 3.0]]
    result = filter_groups(groups, lambda g: g, mean_range=(0.25, 1.0))
    assert result.kept == [[0.0, 1.0]]  # means 0.5 kept; 0.25 (boundary) and 2.5 dropped
    assert (result.num_all_equal, result.num_out_of_range) == (0, 2)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="at least 2 samples"):
        filter_groups([[1.0, 0.0], [1.0]], lambda g: g)
    with pytest.raises(ValueError, match="at least 2 samples"):
        has_spread([])
    with pytest.raises(ValueError, match="min_spread"):
        filter_groups([], lambda g: g, min_spread=-1)
    with pytest.raises(ValueError, match="mean_range"):
        filter_groups([], lambda g: g, mean_range=(1.0, 0.0))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=6), max_size=12))
def test_partition_and_order(groups: list[list[float]]) -> None:
    """Every group is kept or dropped exactly once, in input order; kept iff not all equal."""
    result = filter_groups(groups, lambda g: g)
    assert result.num_kept + result.num_dropped == len(groups)
    assert result.kept == [g for g in groups if len(set(g)) > 1]
    assert result.dropped == [g for g in groups if len(set(g)) == 1]
