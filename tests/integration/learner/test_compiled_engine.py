"""torch.compile'd engines (inductor, which runs the C++ compiler in child processes): the warm-up runs where
DeepSpeed trains, and a compiled engine trains like the eager one, with and without shared prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_offline_engine import CFG
from test_prompt_sharing import grouped_rows, plain_logits
from transformers import AutoModelForCausalLM

from streamrl.learner import engine as engine_module
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.engine import ModelEngine, training_device
from streamrl.learner.prompt_sharing import shared_prompt_logits


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


def test_compiled_engine_trains_the_same_with_shared_prompts(tiny_qwen_dir: Path) -> None:
    cfg = DeepSpeedConfig(zero_stage=0, dtype="fp32", lr=1e-3, scheduler="constant", micro_batch_size=6)
    eager = ModelEngine.from_config(str(tiny_qwen_dir), cfg)
    shared = ModelEngine.from_config(str(tiny_qwen_dir), cfg.model_copy(update={"compile": True}), shared_prompts=True)
    for engine, forward in ((eager, plain_logits), (shared, shared_prompt_logits)):
        for seed in range(3):
            ids, mask, prompt_lens, response_lens = grouped_rows(seed)
            width = int(response_lens.max())
            valid = torch.arange(width)[None, :] < response_lens[:, None]
            logits = forward(engine, ids, mask, prompt_lens, width)
            logp = torch.log_softmax(logits.float(), -1)[..., 7] * valid
            engine.backward(-logp.sum() / valid.sum())
            engine.step()
    expected = dict(eager.iter_full_params())
    for name, tensor in shared.iter_full_params():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-4, msg=name)
