"""The learner's engine starts in a process whose torch.distributed world something else destroyed.

A vLLM engine's shutdown calls ``torch.distributed.destroy_process_group`` directly; DeepSpeed keeps the
groups it built in the old world and its next ``initialize`` broadcast over a dead group
("Group ... is not registered"). In the full test run an in-process vLLM test between two learner tests did this.
"""

from __future__ import annotations

from pathlib import Path

import torch

from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.engine import ModelEngine

CFG = DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant")


def test_an_engine_starts_after_the_world_was_destroyed_behind_deepspeeds_back(tiny_qwen_dir: Path) -> None:
    first = ModelEngine.from_config(str(tiny_qwen_dir), CFG)
    assert torch.distributed.is_initialized()
    torch.distributed.destroy_process_group()
    second = ModelEngine.from_config(str(tiny_qwen_dir), CFG)
    assert torch.distributed.is_initialized()
    for a, b in zip(first.module.parameters(), second.module.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())
