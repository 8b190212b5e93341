"""Checkpoint retention: the pruning function on plain folders (the RL learner pruning as it saves: integration).

Newest is by step number, not by name (``step_100`` is newer than ``step_20``), and the checkpoint
``latest`` names always survives, so a resume finds it.
"""

from __future__ import annotations

from pathlib import Path

from streamrl.learner.checkpoint_retention import prune_checkpoints


def make_checkpoints(directory: Path, steps: list[int], latest: int | None) -> None:
    for step in steps:
        (directory / f"step_{step}").mkdir(parents=True)
        (directory / f"step_{step}" / "state.pt").write_bytes(b"x")
    if latest is not None:
        (directory / "latest").write_text(f"step_{latest}")


def left(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_keeps_the_newest_by_step_number_not_by_name(tmp_path: Path) -> None:
    make_checkpoints(tmp_path, [5, 20, 100, 9], latest=100)
    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step_5", "step_9"]
    assert left(tmp_path) == ["latest", "step_100", "step_20"]


def test_never_deletes_the_checkpoint_latest_names(tmp_path: Path) -> None:
    make_checkpoints(tmp_path, [10, 20, 30], latest=10)  # e.g. newer tags left by a run that was rolled back
    prune_checkpoints(tmp_path, keep_last=1)
    assert left(tmp_path) == ["latest", "step_10", "step_30"]


def test_leaves_other_entries_and_too_few_checkpoints_alone(tmp_path: Path) -> None:
    make_checkpoints(tmp_path, [1, 2], latest=2)
    (tmp_path / "critic").mkdir()
    (tmp_path / "step_notes").mkdir()
    (tmp_path / "latest.tmp").write_text("step_2")
    assert prune_checkpoints(tmp_path, keep_last=2) == []
    assert left(tmp_path) == ["critic", "latest", "latest.tmp", "step_1", "step_2", "step_notes"]
