"""The vision-language learner under ZeRO 2 and 3 on one rank: log-probs equal transformers', a step trains the
tower (DeepSpeed ZeRO-3 probes the NUMA layout with numactl)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_vision_learner import ZERO0, batch_of, group, reference_forward
from transformers import AutoModelForImageTextToText, AutoProcessor

from streamrl.learner.rl.batch import collate
from streamrl.learner.rl.config import LearnerConfig
from streamrl.learner.rl.trainer import RLTrainer
from streamrl.torchkit.testing import build_tiny_idefics3


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_idefics3(tmp_path_factory.mktemp("tiny_idefics3"))


@pytest.fixture(scope="module")
def processor(vl_dir: Path) -> Any:
    return AutoProcessor.from_pretrained(vl_dir)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_stages_on_one_rank(vl_dir: Path, processor: Any, zero_stage: int) -> None:
    ds = ZERO0.model_copy(update={"zero_stage": zero_stage})
    trainer = RLTrainer(LearnerConfig(model=str(vl_dir), ds=ds))
    trajs = group(processor)
    rl = collate(batch_of(trajs), trainer.pad_id, trainer.images)
    reference = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        got, _ = trainer._logprobs(trainer.policy, rl, with_entropy=False)
        for i, traj in enumerate(trajs):
            want, _ = reference_forward(reference, processor, traj)
            torch.testing.assert_close(got[i, : len(want)], want, rtol=0, atol=2e-5)
    before = {n: t.clone() for n, t in trainer.policy.iter_full_params()}
    trainer.step(batch_of(trajs))
    after = dict(trainer.policy.iter_full_params())
    tower = "model.vision_model.post_layernorm.weight"
    assert not torch.equal(after[tower], before[tower])
