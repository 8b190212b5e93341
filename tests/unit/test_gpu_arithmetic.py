"""examples/gpu_arithmetic/prepare.py and recipes/gpu_arithmetic.toml: the GPU recipe that learns.

Here: the learning-rate schedule and the recipe. The warm start (a real training run on the CPU with the
tiny Qwen2 shape and a stand-in tokenizer; the real Qwen2 tokenizer comes from a registry package CI does
not install) is in tests/integration/gpu/test_gpu_arithmetic_warm_start.py; the 0.5B run is on the GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

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
