"""When an in-flight group is overdue: counted from when it could start (its version was published)."""

from __future__ import annotations

from streamrl.coordinator.groups import InFlight, overdue


def test_overdue_counts_from_when_a_group_could_start() -> None:
    groups = {"a": InFlight(0, 100.0), "b": InFlight(1, 100.0), "c": InFlight(2, 100.0)}
    seen = {0: 50.0, 1: 180.0}  # version 1 was published 80 s after b was issued (b was prefetched)
    assert overdue(groups, version=1, version_seen_at=seen, now=200.0, timeout_s=60.0) == ["a"]
    assert overdue(groups, version=1, version_seen_at=seen, now=241.0, timeout_s=60.0) == ["a", "b"]
    # c still waits for version 2: never overdue, however long the learner takes
    assert "c" not in overdue(groups, version=1, version_seen_at=seen, now=1e9, timeout_s=60.0)
    assert InFlight.parse(InFlight(7, 12.5).encode()) == InFlight(7, 12.5)
