"""ModelEngine on CPU: ZeRO stages agree, full parameters and HF export round-trip, LoRA merges, QLoRA refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from streamrl.learner.ds_config import DeepSpeedConfig, LoraConfig
from streamrl.learner.engine import ModelEngine, lr_multiplier

CFG = DeepSpeedConfig(zero_stage=0, dtype="fp32", lr=1e-3, scheduler="constant", micro_batch_size=2, grad_accum=2)


def _train_two_steps(engine: ModelEngine) -> list[bool]:
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


@pytest.mark.filterwarnings("ignore::FutureWarning")  # DeepSpeed's ZeRO-3 gather calls a deprecated torch API
def test_zero3_matches_zero0_and_exports(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    plain = ModelEngine.from_config(str(tiny_qwen_dir), CFG)
    assert _train_two_steps(plain) == [False, True, False, True]
    expected = dict(plain.iter_full_params())
    sharded = ModelEngine.from_config(str(tiny_qwen_dir), CFG.model_copy(update={"zero_stage": 3}))
    _train_two_steps(sharded)
    got = dict(sharded.iter_full_params(bucket_bytes=4096))  # many small gather groups
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=0, msg=name)

    out = sharded.export_hf(tmp_path / "export")
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, tensor in exported.named_parameters():
        torch.testing.assert_close(tensor.detach(), expected[name], atol=1e-5, rtol=0, msg=name)
    assert exported.config.use_cache is True


def test_lora_export_merges_adapters(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    engine = ModelEngine.from_config(str(tiny_qwen_dir), CFG, lora=LoraConfig(rank=4, alpha=8))
    trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    _train_two_steps(engine)
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


def _train_two_steps_logits(engine: ModelEngine) -> None:
    """As the RL trainer drives it: logits from the forward, the loss computed outside the model."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(3, 259, (2, 10), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, 7:] = 0
        logits = engine(input_ids=ids, attention_mask=mask).logits
        ids, mask = ids.to(logits.device), mask.to(logits.device)  # the engine's device (a GPU when there is one)
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        engine.backward(-(logp * mask[:, 1:]).sum() / mask[:, 1:].sum())
        engine.step()


def test_compiled_engine_trains_like_the_eager_one(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    eager = ModelEngine.from_config(str(tiny_qwen_dir), CFG)
    compiled = ModelEngine.from_config(str(tiny_qwen_dir), CFG.model_copy(update={"compile": True}))
    assert all(p.grad is None for p in compiled.module.parameters()), "the warm-up leaves no gradient"
    _train_two_steps_logits(eager)
    _train_two_steps_logits(compiled)
    expected, got = dict(eager.iter_full_params()), dict(compiled.iter_full_params())
    assert got.keys() == expected.keys(), "compiling in place keeps Hugging Face parameter names"
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    exported = AutoModelForCausalLM.from_pretrained(compiled.export_hf(tmp_path / "export"), dtype=torch.float32)
    assert {n for n, _ in exported.named_parameters()} == set(expected)
    with pytest.raises(ValueError, match="zero_stage <= 2"):
        DeepSpeedConfig(compile=True, zero_stage=3)
