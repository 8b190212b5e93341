"""ModelEngine on CPU: LR schedule, DeepSpeed dict, LoRA merges, value head, QLoRA refused (ZeRO-3: integration)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from streamrl.learner.ds_config import DeepSpeedConfig, LoraConfig
from streamrl.learner.engine import ModelEngine, lr_multiplier

CFG = DeepSpeedConfig(zero_stage=0, dtype="fp32", lr=1e-3, scheduler="constant", micro_batch_size=2, grad_accum=2)


def train_two_steps(engine: ModelEngine) -> list[bool]:
    gen = torch.Generator().manual_seed(0)
    boundaries = []
    for _ in range(4):
        ids = torch.randint(3, 259, (2, 10), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        boundaries.append(engine.step())
    return boundaries


def test_lr_schedule_shapes() -> None:
    assert [lr_multiplier(s, 2, 10, "constant", 0.1) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_multiplier(10, 2, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_multiplier(6, 2, 10, "cosine", 0.0) == pytest.approx(0.5)
    assert lr_multiplier(6, 2, 10, "linear", 0.0) == pytest.approx(0.5)


def test_deepspeed_dict() -> None:
    ds = DeepSpeedConfig(zero_stage=3, dtype="bf16", betas=(0.9, 0.99)).to_deepspeed_dict()
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["optimizer"]["params"]["betas"] == [0.9, 0.99]
    frozen = DeepSpeedConfig(zero_stage=2).to_deepspeed_dict(train=False)
    assert "optimizer" not in frozen and frozen["zero_optimization"]["stage"] == 0
    with pytest.raises(ValueError, match="betas"):
        DeepSpeedConfig(betas=(0.9, 1.0))


def test_lora_export_merges_adapters(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    engine = ModelEngine.from_config(str(tiny_qwen_dir), CFG, lora=LoraConfig(rank=4, alpha=8))
    trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    train_two_steps(engine)
    names = [n for n, _ in engine.iter_full_params()]
    assert names == [n for n, _ in AutoModelForCausalLM.from_pretrained(tiny_qwen_dir).named_parameters()]

    ids = torch.randint(3, 259, (2, 9), generator=torch.Generator().manual_seed(1))
    engine.train(False)
    with torch.no_grad():
        adapted = engine(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(engine.export_hf(tmp_path / "m"), dtype=torch.float32)
        base = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32)
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, atol=1e-4, rtol=0)
        assert (base(input_ids=ids).logits - adapted).abs().max() > 1e-3  # the adapters did change the model


def test_value_model_scores_every_token(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    engine = ModelEngine.from_config(str(tiny_qwen_dir), CFG, kind="value")
    ids = torch.randint(3, 259, (2, 7))
    assert engine(input_ids=ids).logits.shape == (2, 7, 1)
    out = engine.export_hf(tmp_path / "critic")
    assert AutoModelForTokenClassification.from_pretrained(out).config.num_labels == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_qlora_is_refused_on_cpu(tiny_qwen_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        ModelEngine.from_config(str(tiny_qwen_dir), CFG, lora=LoraConfig(load_in_4bit=True))
