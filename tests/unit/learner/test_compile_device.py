"""The learner's torch.compile warm-up runs on the device the model trains on (the GPU when there is one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from streamrl.learner import engine as engine_module
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.engine import ModelEngine, training_device


def test_training_device_is_the_local_rank_gpu_when_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert training_device() == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training_device() == torch.device("cpu")


def test_the_warm_up_runs_where_deepspeed_trains(tiny_qwen_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.device] = []
    real = engine_module.compile_and_warm_up

    def recording(model: Any, **kwargs: Any) -> float:
        seen.append(next(model.parameters()).device)
        return real(model, **kwargs)

    monkeypatch.setattr(engine_module, "compile_and_warm_up", recording)
    cfg = DeepSpeedConfig(zero_stage=0, dtype="fp32", scheduler="constant", compile=True)
    engine = ModelEngine.from_config(str(tiny_qwen_dir), cfg)
    assert seen == [training_device()] and engine.device == training_device()
