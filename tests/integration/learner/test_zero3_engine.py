"""ZeRO-3 (DeepSpeed probes the NUMA layout with a numactl child process on CPU) trains like ZeRO-0: full
parameters, HF export, and the flat forwards' loss, gradient norm and step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_lm_forward import sft_samples
from test_offline_engine import CFG, train_two_steps
from transformers import AutoModelForCausalLM

from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.engine import ModelEngine
from streamrl.learner.lm_forward import rows_nll
from streamrl.learner.packing import pack_samples


@pytest.mark.filterwarnings("ignore::FutureWarning")  # DeepSpeed's ZeRO-3 gather calls a deprecated torch API
def test_zero3_matches_zero0_and_exports(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    plain = ModelEngine.from_config(str(tiny_qwen_dir), CFG)
    assert train_two_steps(plain) == [False, True, False, True]
    expected = dict(plain.iter_full_params())
    sharded = ModelEngine.from_config(str(tiny_qwen_dir), CFG.model_copy(update={"zero_stage": 3}))
    train_two_steps(sharded)
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


@pytest.mark.filterwarnings("ignore::FutureWarning")  # DeepSpeed's ZeRO-3 gather calls a deprecated torch API
def test_zero3_trains_like_zero0_through_the_flat_forwards(tiny_qwen_dir: Path) -> None:
    """Under ZeRO-3 the flat row goes through the engine's forward (calling the body and head modules
    apart gave wrong gradients there): the SFT loss, its gradient norm and the loss after one
    optimizer step match ZeRO-0."""
    ds = DeepSpeedConfig(zero_stage=0, dtype="fp32", lr=1e-3, scheduler="constant", grad_clip=1e6, grad_accum=2)
    rows = pack_samples(sft_samples(seed=2), seq_len=16, pad_id=0)
    micro = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    results = []
    for stage in (0, 3):
        cfg = ds.model_copy(update={"zero_stage": stage})
        engine = ModelEngine.from_config(str(tiny_qwen_dir), cfg)
        loss = 0.0
        for part in micro:  # an optimizer step of two micro-batches
            part_loss, _ = rows_nll(engine, part, cfg)
            engine.backward(part_loss)
            engine.step()
            loss += float(part_loss.detach())
        after, _ = rows_nll(engine, rows, cfg)
        results.append((loss, engine.grad_norm, float(after.detach())))
    (loss0, norm0, after0), (loss3, norm3, after3) = results
    assert loss3 == pytest.approx(loss0, rel=1e-5)
    assert norm0 is not None and norm3 == pytest.approx(norm0, rel=1e-4)
    assert after3 == pytest.approx(after0, rel=1e-4) and after0 < loss0
