"""The coordinator's error budget: too many of the groups settled lately failed -> issuing pauses for a window,
said once; then it resumes with a fresh window (and trips again if the failure lasts)."""

from __future__ import annotations

from streamrl.coordinator.error_budget import ErrorBudget


def test_a_failure_every_group_meets_trips_after_a_step_then_pauses_for_the_window() -> None:
    budget = ErrorBudget(max_dead_fraction=0.5, window_s=60.0, min_groups=32)
    for i in range(31):
        budget.record(float(i) / 10, failed=1)
        assert budget.check(float(i) / 10) is None  # fewer than a step's groups settled: no judgement yet
    budget.record(3.1, failed=1)
    cause = budget.check(3.1)
    assert cause is not None and cause.startswith("error budget spent: 32 of the 32 groups settled in the last 60 s")
    assert "coordinator.max_dead_fraction = 0.5" in cause
    assert budget.paused(3.2) and budget.check(3.2) is None  # said once
    budget.record(10.0, failed=100)  # groups failing while paused met the same cause: no next window's budget
    assert not budget.paused(63.2)  # the window passed: issuing resumes (half-open)
    for _ in range(31):
        budget.record(64.0, failed=1)
    assert budget.check(64.0) is None  # a fresh window: a step's worth of failures again before it trips
    budget.record(64.0, failed=1)
    assert budget.check(64.0) is not None


def test_only_the_groups_settled_within_the_window_count() -> None:
    budget = ErrorBudget(max_dead_fraction=0.5, window_s=60.0, min_groups=32)
    budget.record(0.0, failed=16, completed=16)  # half failed: not more than the fraction
    assert budget.check(0.0) is None
    budget.record(2.0, failed=40)  # 56 of 72: over
    budget.record(61.5, completed=32)  # ... but the first record left the window: 40 of 72
    assert budget.check(61.5) is not None
    fresh = ErrorBudget(max_dead_fraction=0.5, window_s=60.0, min_groups=32)
    fresh.record(0.0, failed=40)
    fresh.record(30.0, completed=8)
    assert fresh.check(61.0) is None  # the failures aged out: 8 settled, all completed


def test_a_fraction_of_one_never_trips() -> None:
    budget = ErrorBudget(max_dead_fraction=1.0, window_s=60.0, min_groups=1)
    budget.record(0.0, failed=1000)
    assert budget.check(0.0) is None
