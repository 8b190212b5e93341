"""The learner trains on the local rank's GPU when there is one, else the CPU (the compiled warm-up: integration)."""

from __future__ import annotations

import pytest
import torch

from streamrl.learner.engine import training_device


def test_training_device_is_the_local_rank_gpu_when_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert training_device() == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training_device() == torch.device("cpu")
