"""examples/gpu_arithmetic/prepare.py and recipes/gpu_arithmetic.toml: the GPU recipe that learns.

The warm start runs here on the CPU with the tiny Qwen2 shape and a stand-in tokenizer (the real
Qwen2 tokenizer comes from a registry package CI does not install); the 0.5B run is on the GPU.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import model as model_lib
import pytest
import qwen2_model as qwen2_lib

from streamrl.common.config import load_config
from streamrl.coordinator.config import CoordinatorConfig
from streamrl.learner.rl.config import LearnerConfig
from streamrl.rollout.config import RolloutConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "gpu_arithmetic.toml"
_spec = importlib.util.spec_from_file_location("gpu_arithmetic_prepare", ROOT / "examples/gpu_arithmetic/prepare.py")
assert _spec is not None and _spec.loader is not None
gpu_prepare = importlib.util.module_from_spec(_spec)
sys.modules["gpu_arithmetic_prepare"] = gpu_prepare
_spec.loader.exec_module(gpu_prepare)


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


def test_learning_rate_warms_up_then_holds() -> None:
    config = gpu_prepare.GpuPrepareConfig(lr=1e-3, warmup_steps=10)
    assert [gpu_prepare.lr_at(s, config) for s in (1, 5, 10, 11, 500)] == pytest.approx([1e-4, 5e-4, 1e-3, 1e-3, 1e-3])
    assert gpu_prepare.lr_at(1, gpu_prepare.GpuPrepareConfig(lr=1e-3, warmup_steps=0)) == 1e-3


def test_recipe_learns_from_the_prepared_policy_with_held_out_evaluation() -> None:
    prepare = load_config(gpu_prepare.GpuPrepareConfig, RECIPE, [], section="prepare")
    coordinator = load_config(CoordinatorConfig, RECIPE, [], section="coordinator")
    rollout = load_config(RolloutConfig, RECIPE, [], section="rollout")
    learner = load_config(LearnerConfig, RECIPE, [], section="learner")
    model = f"{prepare.out_dir}/model"
    assert prepare.preset == "qwen2_0.5b" and rollout.engine.model == learner.model == model
    assert coordinator.eval.dataset is not None and coordinator.eval.dataset.path == f"{prepare.out_dir}/eval.jsonl"
    assert coordinator.eval.every_steps <= 10 and coordinator.eval.num_prompts == prepare.num_eval
    assert rollout.engine.max_num_seqs >= coordinator.eval.num_prompts
    assert (rollout.engine.device, learner.weights_transport, learner.ds.dtype) == ("cuda", "ipc", "bf16")
