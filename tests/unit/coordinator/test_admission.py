"""Admission control keeps every issued group within max_staleness of the version that trains it."""

from __future__ import annotations

from streamrl.coordinator.admission import groups_admissible


def test_sync_mode_issues_one_batch_per_version() -> None:
    # version 0: the prompts of batch 0 only
    assert groups_admissible(accepted=0, in_flight=0, version=0, max_staleness=0, prompts_per_step=4, total_steps=10) == 4
    assert groups_admissible(accepted=4, in_flight=0, version=0, max_staleness=0, prompts_per_step=4, total_steps=10) == 0
    assert groups_admissible(accepted=4, in_flight=0, version=1, max_staleness=0, prompts_per_step=4, total_steps=10) == 4


def test_async_mode_runs_ahead_by_max_staleness_batches() -> None:
    assert groups_admissible(accepted=0, in_flight=0, version=0, max_staleness=2, prompts_per_step=4, total_steps=10) == 12
    assert groups_admissible(accepted=5, in_flight=3, version=0, max_staleness=2, prompts_per_step=4, total_steps=10) == 4


def test_dropped_groups_are_replaced_and_the_run_end_caps_issuing() -> None:
    # 2 of 4 in-flight groups were filtered out: they left both counts, so 2 replacements are allowed
    assert groups_admissible(accepted=2, in_flight=0, version=0, max_staleness=0, prompts_per_step=4, total_steps=10) == 2
    assert groups_admissible(accepted=8, in_flight=0, version=1, max_staleness=5, prompts_per_step=4, total_steps=2) == 0
