"""Admission control keeps every issued group within max_staleness of the version that trains it."""

from __future__ import annotations

from streamrl.coordinator.admission import groups_admissible, new_group_versions, repaid, required_version


def test_sync_mode_issues_one_batch_per_version() -> None:
    # version 0: the prompts of batch 0 only
    assert (
        groups_admissible(accepted=0, in_flight=0, version=0, max_staleness=0, prompts_per_step=4, total_steps=10) == 4
    )
    assert (
        groups_admissible(accepted=4, in_flight=0, version=0, max_staleness=0, prompts_per_step=4, total_steps=10) == 0
    )
    assert (
        groups_admissible(accepted=4, in_flight=0, version=1, max_staleness=0, prompts_per_step=4, total_steps=10) == 4
    )


def test_async_mode_runs_ahead_by_max_staleness_batches() -> None:
    assert (
        groups_admissible(accepted=0, in_flight=0, version=0, max_staleness=2, prompts_per_step=4, total_steps=10) == 12
    )
    assert (
        groups_admissible(accepted=5, in_flight=3, version=0, max_staleness=2, prompts_per_step=4, total_steps=10) == 4
    )


def test_dropped_groups_are_replaced_and_the_run_end_caps_issuing() -> None:
    # 2 of 4 in-flight groups were filtered out: they left both counts, so 2 replacements are allowed
    assert (
        groups_admissible(accepted=2, in_flight=0, version=0, max_staleness=0, prompts_per_step=4, total_steps=10) == 2
    )
    assert (
        groups_admissible(accepted=8, in_flight=0, version=1, max_staleness=5, prompts_per_step=4, total_steps=2) == 0
    )


def test_prefetch_issues_the_next_batch_early_tagged_with_the_version_it_needs() -> None:
    # sync mode, version 0, prefetch 1: batch 0 and batch 1 may be issued...
    kw = dict(max_staleness=0, prompts_per_step=4, total_steps=10)
    assert groups_admissible(accepted=0, in_flight=0, version=0, prefetch_steps=1, **kw) == 8
    assert groups_admissible(accepted=4, in_flight=4, version=0, prefetch_steps=1, **kw) == 0
    # ...but batch 1's prompts ask for version 1: sampled at version 0 they would be one step stale
    want = [required_version(position=p, version=0, max_staleness=0, prompts_per_step=4) for p in range(8)]
    assert want == [0, 0, 0, 0, 1, 1, 1, 1]
    # async (max_staleness 1): batch 2 may be generated at version 1, not earlier
    assert required_version(position=8, version=0, max_staleness=1, prompts_per_step=4) == 1
    assert required_version(position=8, version=3, max_staleness=1, prompts_per_step=4) == 3  # never below V
    assert groups_admissible(accepted=36, in_flight=0, version=9, prefetch_steps=3, **kw) == 4  # capped by the run


def test_a_replacement_takes_the_version_owed_by_the_group_it_replaces() -> None:
    # sync, one batch prefetched: 3 groups of batch 0 accepted, batch 1's 4 waiting for version 1, and
    # batch 0's last group lost. By its position (7) a replacement would need version 1 - which only
    # comes after batch 0 is trained, which needs the replacement: the run would wait forever.
    kw = dict(version=0, max_staleness=0, prompts_per_step=4)
    assert new_group_versions(1, owed=[], position=7, **kw) == [1]
    assert new_group_versions(1, owed=[0], position=7, **kw) == [0]
    # owed versions go first, lowest first (the earliest batch waits for them); then by position
    assert new_group_versions(3, owed=[2, 1], position=8, **kw) == [1, 2, 2]
    assert new_group_versions(1, owed=[3, 1], position=8, **kw) == [1]
    assert new_group_versions(0, owed=[1], position=8, **kw) == []


def test_a_replacement_requires_the_current_version_when_it_owes_an_older_one() -> None:
    # a group of batch 3 (it required version 2) failed while the policy is at 4: its replacement is generated
    # at 4 at the earliest, and requires that - what the batch builder reads to know its last batch (5)
    kw = dict(max_staleness=1, prompts_per_step=4)
    assert new_group_versions(2, owed=[2, 5], position=20, version=4, **kw) == [4, 5]
    assert repaid(1, [5, 2]) == [2]  # the owed versions repaid are the lowest, as they were owed
