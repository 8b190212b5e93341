"""Checkpoints are on disk before they count (streamrl.learner.durable, ModelEngine.save_checkpoint,
LearnerGroup.checkpoint): every file and folder fsync'ed before ``latest`` names the checkpoint (and
so before the learner acknowledges the batches it covers), ``latest`` replaced atomically and its
folder fsync'ed after, and the critic's checkpoint written before the policy's ``latest``. A whole DeepSpeed
checkpoint in its own process: tests/integration/learner/test_durable_checkpoint_process.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from streamrl.learner import durable


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    calls: list[str] = []
    real = durable.fsync
    monkeypatch.setattr(durable, "fsync", lambda path: (calls.append(os.path.relpath(path, tmp_path)), real(path)))
    return calls


def test_sync_tree_syncs_every_file_then_the_folders_bottom_up_then_the_parent(
    tmp_path: Path, synced: list[str]
) -> None:
    (tmp_path / "ckpt" / "step_3" / "zero").mkdir(parents=True)
    for name in ("step_3/model.pt", "step_3/zero/optim.pt", "step_3/rng_rank0.pt"):
        (tmp_path / "ckpt" / name).write_bytes(b"x")
    durable.sync_tree(tmp_path / "ckpt" / "step_3")
    files = [c for c in synced if c.endswith(".pt")]
    assert sorted(files) == ["ckpt/step_3/model.pt", "ckpt/step_3/rng_rank0.pt", "ckpt/step_3/zero/optim.pt"]
    assert synced[len(files) :] == ["ckpt/step_3/zero", "ckpt/step_3", "ckpt"]


def test_write_marker_syncs_the_new_file_before_the_rename_and_the_folder_after(
    tmp_path: Path, synced: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_replace = os.replace
    monkeypatch.setattr(durable.os, "replace", lambda a, b: (synced.append("rename"), real_replace(a, b)))
    (tmp_path / "latest").write_text("step_2")
    durable.write_marker(tmp_path / "latest", "step_3")
    assert synced == ["latest.tmp", "rename", "."]
    assert (tmp_path / "latest").read_text() == "step_3" and not (tmp_path / "latest.tmp").exists()


class _Model:
    def __init__(self, name: str, log: list[tuple[str, ...]], global_steps: int = 7) -> None:
        self.name, self.log, self.global_steps = name, log, global_steps
        self.rank, self.world_size = 0, 1

    def save_checkpoint(self, directory: Path, client_state: dict[str, Any], tag: str | None = None) -> str:
        self.log.append((self.name, "save", str(tag)))
        (directory / str(tag)).mkdir(parents=True)
        durable.write_marker(directory / "latest", str(tag))
        return str(tag)

    def load_checkpoint(self, directory: Path, tag: str | None = None) -> dict[str, Any] | None:
        self.log.append((self.name, "load", str(tag)))
        return {"step": 7} if (directory / "latest").is_file() else None


def test_the_critics_checkpoint_is_written_before_the_policys_and_resumed_at_the_policys_tag(tmp_path: Path) -> None:
    from streamrl.learner.rl.group import LearnerGroup

    log: list[tuple[str, ...]] = []
    trainer = SimpleNamespace(
        policy=_Model("policy", log), critic=_Model("critic", log), kl_ctl=SimpleNamespace(value=0.1)
    )
    group = LearnerGroup(trainer, tmp_path, keep_last=2)  # type: ignore[arg-type]
    group.checkpoint({"step": 3, "next_index": 3})
    assert log == [("critic", "save", "step_7"), ("policy", "save", "step_7")]
    # the critic's newest checkpoint is ahead of the policy's (killed between the two saves): the resume
    # still takes the critic's checkpoint of the policy's tag
    (tmp_path / "critic" / "step_8").mkdir()
    (tmp_path / "critic" / "latest").write_text("step_8")
    log.clear()
    group.resume()
    assert log == [("policy", "load", "None"), ("critic", "load", "step_7")]
