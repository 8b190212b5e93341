"""The RL learner prunes its checkpoints as it saves and resumes from latest (DeepSpeed's optimizer build
compiles a probe with gcc in a child process)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from unittest.mock import MagicMock

import torch
from test_checkpoint_retention import left
from test_trainer_updates import scored_batch

from streamrl.common.lifecycle import ServiceContext
from streamrl.common.streams import StreamNames
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.rl.config import LearnerConfig
from streamrl.learner.rl.group import LearnerGroup
from streamrl.learner.rl.service import LearnerService
from streamrl.learner.rl.trainer import RLTrainer


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
        service.publisher.close()
    assert left(group.ckpt_dir) == ["latest", "step_3", "step_4"]
    assert (group.ckpt_dir / "latest").read_text() == "step_4"

    resumed = RLTrainer(cfg)
    state = resumed.policy.load_checkpoint(group.ckpt_dir)
    assert state is not None and state["step"] == 4 and state["next_index"] == 4
    assert state["batch_id"] == "batch-3" and state["metrics"] == {"learner/loss/total": 0.5}  # the step's event
    trained = dict(service.trainer.policy.module.named_parameters())
    for name, p in resumed.policy.module.named_parameters():
        torch.testing.assert_close(p.detach(), trained[name].detach(), msg=name)
