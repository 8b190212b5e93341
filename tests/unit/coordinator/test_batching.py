"""Batch selection: oldest groups first, never over the staleness bound, never a short batch."""

from __future__ import annotations

from streamrl.coordinator.batching import ReadyGroup, select_groups


def groups(*versions: int) -> list[ReadyGroup]:
    return [ReadyGroup(f"g{i}", v) for i, v in enumerate(versions)]


def test_oldest_first_within_the_bound() -> None:
    # completion order: fresh groups finished before an older one; the older one must go first
    pick = select_groups(groups(5, 5, 4, 5), index=5, max_staleness=1, per_step=2, drop_stale=True)
    assert [g.group_id for g in pick.chosen] == ["g2", "g0"]
    assert pick.too_stale == []


def test_too_stale_groups_are_reported_and_never_batched() -> None:
    pick = select_groups(groups(2, 4, 5, 5), index=5, max_staleness=1, per_step=3, drop_stale=True)
    assert [g.group_id for g in pick.too_stale] == ["g0"]
    assert [g.group_id for g in pick.chosen] == ["g1", "g2", "g3"]


def test_no_short_batch_and_keep_policy() -> None:
    pick = select_groups(groups(1, 5), index=5, max_staleness=0, per_step=2, drop_stale=True)
    assert pick.chosen == [] and [g.group_id for g in pick.too_stale] == ["g0"]
    kept = select_groups(groups(1, 5), index=5, max_staleness=0, per_step=2, drop_stale=False)
    assert [g.group_id for g in kept.chosen] == ["g0", "g1"] and kept.too_stale == []
