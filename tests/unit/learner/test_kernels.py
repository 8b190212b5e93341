"""The fused-kernel switch: ``none`` and ``auto`` without a GPU leave the model alone, ``liger`` without one
is a clear error; where liger-kernel is installed, only the patched model changes, not the model type's
module (other models of the type, CPU ones included, keep the eager code)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen2 import modeling_qwen2

from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.kernels import apply_kernels


def test_none_and_auto_without_a_gpu_leave_the_model_alone(
    tiny_qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32)
    assert apply_kernels(model, "none") is False and apply_kernels(model, "auto") is False
    assert "forward" not in vars(model.model.norm)
    with pytest.raises(ValueError, match="kernels = 'liger' needs a CUDA GPU"):
        apply_kernels(model, "liger")


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
def test_only_the_patched_model_changes(tiny_qwen_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):  # restored after the test whatever happens
        monkeypatch.setattr(modeling_qwen2, name, getattr(modeling_qwen2, name))
    norm_class, mlp_class = modeling_qwen2.Qwen2RMSNorm, modeling_qwen2.Qwen2MLP
    ids = torch.randint(3, 259, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32)(input_ids=ids).logits
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    patched = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32)
    assert apply_kernels(patched, "auto") and apply_kernels(patched, "liger")
    assert "forward" in vars(patched.model.norm) and "forward" in vars(patched.model.layers[0].mlp)
    assert modeling_qwen2.Qwen2RMSNorm is norm_class and modeling_qwen2.Qwen2MLP is mlp_class
    other = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32)
    assert "forward" not in vars(other.model.norm)
    with torch.no_grad():  # a CPU model of the same type still runs the eager code (rotary included)
        torch.testing.assert_close(other(input_ids=ids).logits, before)


def test_the_config_and_the_deepspeed_dict() -> None:
    assert DeepSpeedConfig().kernels == "auto"
    with pytest.raises(ValueError, match="kernels"):
        DeepSpeedConfig(kernels="triton")
    cfg = DeepSpeedConfig(dtype="bf16")
    assert cfg.to_deepspeed_dict(cuda=True)["optimizer"]["params"]["fused"] is True
    assert "fused" not in cfg.to_deepspeed_dict(cuda=False)["optimizer"]["params"]
    unfused = cfg.model_copy(update={"fused_optimizer": False})
    assert "fused" not in unfused.to_deepspeed_dict(cuda=True)["optimizer"]["params"]
    assert cfg.to_deepspeed_dict()["bf16"]["check_grad_overflow"] is False
    assert cfg.model_copy(update={"skip_nonfinite_steps": True}).to_deepspeed_dict()["bf16"]["check_grad_overflow"]
