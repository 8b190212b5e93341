"""Checkpoint retention: the pruning function on plain folders, and the RL learner pruning as it saves.

Newest is by step number, not by name (``step_100`` is newer than ``step_20``), and the checkpoint
``latest`` names always survives, so a resume finds it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from unittest.mock import MagicMock

import torch
from test_trainer_updates import scored_batch

from streamrl.common.lifecycle import ServiceContext
from streamrl.common.streams import StreamNames
from streamrl.learner.checkpoint_retention import prune_checkpoints
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.rl.config import LearnerConfig
from streamrl.learner.rl.group import LearnerGroup
from streamrl.learner.rl.service import LearnerService
from streamrl.learner.rl.trainer import RLTrainer


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


def test_rl_learner_keeps_the_last_checkpoints_and_resumes_from_latest(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    ds = DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant", lr=1e-2, grad_clip=0.0)
    cfg = LearnerConfig(
        model=str(tiny_qwen_dir),
        ds=ds,
        total_steps=4,
        checkpoint_every=1,
        checkpoint_keep_last=2,
        run_dir=str(tmp_path),
    )
    ctx = ServiceContext("learner", "learner-0", cfg, MagicMock(), StreamNames("r"), asyncio.Event())
    trainer = RLTrainer(cfg)
    group = LearnerGroup(trainer, tmp_path / "checkpoints", cfg.checkpoint_keep_last)
    service = LearnerService(cfg, ctx, trainer, group)
    try:
        for k in range(1, 5):
            service.trainer.step(scored_batch(seed=k))
            service.step = service.next_index = k
            service._checkpoint(f"batch-{k - 1}", {"learner/loss/total": 0.5}, "")
    finally:
        assert service.server is not None
        service.server.close()
    assert left(group.ckpt_dir) == ["latest", "step_3", "step_4"]
    assert (group.ckpt_dir / "latest").read_text() == "step_4"

    resumed = RLTrainer(cfg)
    state = resumed.policy.load_checkpoint(group.ckpt_dir)
    assert state is not None and state["step"] == 4 and state["next_index"] == 4
    assert state["batch_id"] == "batch-3" and state["metrics"] == {"learner/loss/total": 0.5}  # the step's event
    trained = dict(service.trainer.policy.module.named_parameters())
    for name, p in resumed.policy.module.named_parameters():
        torch.testing.assert_close(p.detach(), trained[name].detach(), msg=name)
