"""Reward-model job on a tiny Qwen2: held-out pair accuracy, reward statistics in the exported config."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from streamrl.learner.offline.config import RMConfig
from streamrl.learner.offline.rm import run_rm


def test_reward_model_separates_held_out_pairs(kit: SimpleNamespace, tiny_qwen_dir: Path, tmp_path: Path) -> None:
    train = kit.write_jsonl(tmp_path / "train.jsonl", kit.preference_records(192, seed=0))
    held = kit.write_jsonl(tmp_path / "eval.jsonl", kit.preference_records(64, seed=1))
    cfg = RMConfig.model_validate(
        kit.recipe(tmp_path / "run", tiny_qwen_dir, train, held, train={"epochs": 2, "eval_every": 12})
    )
    result = run_rm(cfg)

    assert result.evals[-1]["accuracy"] >= 0.9, result.evals
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    final = result.final_dir
    assert final is not None
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert config["reward_mean"] == pytest.approx(result.evals[-1]["reward_mean"])
    assert config["reward_std"] > 0

    # the export scores like the trained model, through plain transformers
    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": "kl"}, {"role": "assistant", "content": answer}], tokenize=False
        )
        for answer in ("abcd", "vwxy")
    ]
    batch = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    with torch.no_grad():
        good, bad = model(**batch).logits.squeeze(-1).tolist()
    assert good > bad
    best = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert best["metric"] == "accuracy"
    assert best["value"] >= 0.9
