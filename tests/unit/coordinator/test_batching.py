"""Batch selection: oldest groups first, never over the staleness bound, never a short batch."""

from __future__ import annotations

from streamrl.coordinator.batching import ReadyGroup, last_batch, last_chance, select_groups


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


def test_a_batch_waits_for_an_in_flight_group_whose_last_chance_it_is() -> None:
    # batch 5, max_staleness 1: a group generated at 4 can go in batch 5 at the latest. Two of batch 5's groups
    # (version 4) are ready, one is still being scored, and a group of batch 6 (version 5) completed first:
    # filling batch 5 with it would leave the slow one too stale for every later batch - thrown away
    ready = groups(4, 5, 4)
    coming = last_chance([4, 5, 5], index=5, max_staleness=1)
    assert coming == 1
    pick = select_groups(ready, index=5, max_staleness=1, per_step=3, drop_stale=True, last_chance_in_flight=coming)
    assert pick.chosen == [] and pick.waiting_for == 1
    # once it is in, the batch is its own groups
    pick = select_groups([*ready, ReadyGroup("slow", 4)], index=5, max_staleness=1, per_step=3, drop_stale=True)
    assert [g.group_id for g in pick.chosen] == ["g0", "g2", "slow"]


def test_no_wait_when_no_group_of_the_batch_could_go_later() -> None:
    # every chosen group's last batch is this one: swapping would gain nothing, the batch is built
    kw = dict(index=5, max_staleness=1, per_step=2, drop_stale=True)
    pick = select_groups(groups(4, 4), last_chance_in_flight=3, **kw)  # type: ignore[arg-type]
    assert [g.group_id for g in pick.chosen] == ["g0", "g1"] and pick.waiting_for == 0
    # nor for in-flight groups with a later last batch, or already past theirs (too stale whatever happens)
    assert last_chance([5, 6, 3], index=5, max_staleness=1) == 0
    pick = select_groups(groups(4, 5), last_chance_in_flight=0, **kw)  # type: ignore[arg-type]
    assert [g.group_id for g in pick.chosen] == ["g0", "g1"]
    # synchronous: every group's last batch is the one it was issued for
    assert last_batch(5, 0) == 5 and last_chance([5, 5, 6], index=5, max_staleness=0) == 2


def test_too_stale_groups_are_reported_while_the_batch_waits() -> None:
    pick = select_groups(
        groups(3, 4, 5), index=5, max_staleness=1, per_step=2, drop_stale=True, last_chance_in_flight=1
    )
    assert pick.chosen == [] and [g.group_id for g in pick.too_stale] == ["g0"] and pick.waiting_for == 1
