"""SFT job on a tiny Qwen2 (CPU, DeepSpeed ZeRO-0, fp32): it learns a task, exports, and resumes exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.learner.offline.cli import sft_main
from streamrl.learner.offline.config import SFTConfig
from streamrl.learner.offline.sft import run_sft


def _animal_accuracy(kit: SimpleNamespace, model_dir: Path, tokenizer_dir: Path) -> float:
    """Greedy answers that start with the right animal, on held-out prompts."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    records = kit.animal_records(24, seed=7)
    hits = 0
    for r in records:
        messages = [{"role": "user", "content": r["prompt"]}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        hits += tok.decode(out[0, ids.shape[1] :]).startswith(r["response"])
    return hits / len(records)


def test_sft_loss_falls_and_model_does_the_task(kit: SimpleNamespace, tiny_qwen_dir: Path, tmp_path: Path) -> None:
    train = kit.write_jsonl(tmp_path / "train.jsonl", kit.animal_records(256, seed=0))
    held = kit.write_jsonl(tmp_path / "eval.jsonl", kit.animal_records(32, seed=1))
    cfg = SFTConfig.model_validate(kit.recipe(tmp_path / "run", tiny_qwen_dir, train, held, train={"epochs": 2}))
    result = run_sft(cfg)

    losses = [h["loss"] for h in result.history]
    assert len(losses) == 64
    assert sum(losses[-8:]) / 8 < 0.25 * losses[0]
    assert result.evals[-1]["loss"] < 0.5
    final = result.final_dir
    assert final is not None
    assert sorted(p.name for p in final.glob("*.safetensors")) == ["model.safetensors"]
    assert not list(final.glob("*.bin")) and not list(final.glob("*.pt"))
    assert (final / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text())["metric"] == "loss"
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    before, after = _animal_accuracy(kit, tiny_qwen_dir, tiny_qwen_dir), _animal_accuracy(kit, final, final)
    assert after >= before + 0.5, (before, after)


@pytest.fixture
def dropout_model_dir(tiny_qwen_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with attention dropout, so that resuming must restore the RNG too."""
    out = tmp_path / "dropout_model"
    shutil.copytree(tiny_qwen_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["attention_dropout"] = 0.2
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_kill_and_resume_gives_the_same_next_losses(
    kit: SimpleNamespace, dropout_model_dir: Path, tmp_path: Path
) -> None:
    train = kit.write_jsonl(tmp_path / "train.jsonl", kit.animal_records(24, seed=3))
    sections = {
        "train": {"epochs": 2, "save_every": 1, "keep_last": 10, "save_best": False, "export": False},
        "deepspeed": {"micro_batch_size": 4, "grad_accum": 2, "scheduler": "cosine", "warmup_steps": 2},
    }
    full = run_sft(SFTConfig.model_validate(kit.recipe(tmp_path / "a", dropout_model_dir, train, None, **sections)))
    assert [h["step"] for h in full.history] == [1, 2, 3, 4, 5, 6]  # 3 steps per epoch, 2 epochs

    # what a kill right after the step-2 checkpoint leaves on disk (mid-epoch 0)
    ckpt = tmp_path / "b" / "checkpoints"
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_2", ckpt / "step_2")
    (ckpt / "latest").write_text("step_2")
    resumed = run_sft(SFTConfig.model_validate(kit.recipe(tmp_path / "b", dropout_model_dir, train, None, **sections)))

    assert [h["step"] for h in resumed.history] == [3, 4, 5, 6]
    for a, b in zip(full.history[2:], resumed.history, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)


def test_cli_saves_resolved_config_and_rejects_bad_fields(
    kit: SimpleNamespace, tiny_qwen_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = kit.write_jsonl(tmp_path / "train.jsonl", kit.animal_records(8, seed=0))
    recipe = tmp_path / "sft.toml"
    recipe.write_text(
        f'[model]\npath = "{tiny_qwen_dir}"\n[data]\ntrain_path = "{train}"\nmax_len = 64\n'
        f'[train]\nrun_dir = "{tmp_path / "run"}"\nsave_best = false\n'
        '[deepspeed]\nzero_stage = 0\ndtype = "fp32"\nscheduler = "constant"\nmicro_batch_size = 8\n'
        "[logging]\ntensorboard = false\nprogress = false\n"
    )
    assert sft_main([str(recipe), "--deepspeed.zero_stage=7"]) == 2
    assert "deepspeed.zero_stage" in capsys.readouterr().err
    assert sft_main([str(recipe), "--packing=true", "--train.export=false", "--deepspeed.micro_batch_size=2"]) == 0
    saved = SFTConfig.model_validate_json((tmp_path / "run" / "config.sft.json").read_text())
    assert saved.packing is True
    assert saved.deepspeed.zero_stage == 0
