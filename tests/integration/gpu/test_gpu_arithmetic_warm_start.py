"""examples/gpu_arithmetic/prepare.py's warm start, run on the CPU with the tiny Qwen2 shape (the full 151,936-row
vocabulary) and a stand-in tokenizer: it trains, saves and is idempotent (a real training run: ~40 s on 2 cores)."""

from __future__ import annotations

import json
from pathlib import Path

import model as model_lib
import pytest
import qwen2_model as qwen2_lib
from test_gpu_arithmetic import gpu_prepare


@pytest.fixture
def stand_in_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "tokenizer"
    model_lib.build_tokenizer().save_pretrained(folder)
    monkeypatch.setattr(qwen2_lib, "tokenizer_files", lambda cache_dir: folder)


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("stand_in_tokenizer")
def test_warm_start_trains_saves_and_is_idempotent(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "data"
    config = gpu_prepare.GpuPrepareConfig(
        out_dir=str(out),
        preset="qwen2_tiny",
        num_eval=24,
        batch_size=16,
        max_steps=10,
        eval_every_steps=5,
        lr=3e-3,
        warmup_steps=2,
        target_accuracy=1.0,
        device="cpu",
    )
    summary = gpu_prepare.prepare(config)
    assert summary["warm_start_steps"] == 10 and summary["device"] == "cpu"
    assert summary["num_eval"] == 24 and summary["num_train"] == 10_000 - 24
    assert 0.0 <= summary["saved_accuracy"] <= 1.0 and summary["saved_dtype"] == "float32"
    # the loss fell from a random policy's (log of the 151,936-row vocabulary is 11.9)
    assert summary["warm_start_loss"] < 11.0, summary
    policy = AutoModelForCausalLM.from_pretrained(out / "model")
    assert policy.config.model_type == "qwen2"
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and {"prompt", "label"} <= set(rows[0])
    weights = out / "model" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert gpu_prepare.prepare(config) == json.loads((out / "prepare.json").read_text())["summary"]
    assert weights.stat().st_mtime_ns == stamp  # nothing redone
