"""recipes/gpu_7b_*.toml validate in every service and the launcher, and their memory plans for a
Qwen2.5-7B-shaped policy on one 80 GB GPU say what fits (ops/gpu_plan.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import prepare as prepare_lib
import pytest

from streamrl.common.config import apply_overrides, load_config, read_recipe
from streamrl.coordinator.config import CoordinatorConfig
from streamrl.learner.rl.config import LearnerConfig
from streamrl.ops import gpu_plan
from streamrl.ops.launcher import Launcher
from streamrl.reward.__main__ import RewardServiceConfig
from streamrl.rollout.config import RolloutConfig

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
H100 = "--up.gpu_memory_gib=79.2"


def plan_of(recipe: Path, tmp_path: Path, *overrides: str) -> tuple[list[gpu_plan.GpuPlan], str | None]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN25_7B))
    where = [f"--learner.model={model}", f"--rollout.engine.model={model}", H100]
    data: dict[str, Any] = apply_overrides(read_recipe(str(recipe)), [*where, *overrides])
    return gpu_plan.plan_run(data)


def test_the_full_recipe_reads_in_every_service() -> None:
    recipe = RECIPES / "gpu_7b_full.toml"
    coordinator = load_config(CoordinatorConfig, recipe, [], section="coordinator")
    rollout = load_config(RolloutConfig, recipe, [], section="rollout")
    learner = load_config(LearnerConfig, recipe, [], section="learner")
    load_config(RewardServiceConfig, recipe, [], section="reward")
    assert coordinator.max_staleness == 0 and rollout.engine.sleep_between_versions
    assert (learner.ds.zero_stage, learner.ds.offload_optimizer, learner.weights_transport) == (3, True, "ipc")
    assert coordinator.sampling.max_new_tokens + 10 <= rollout.engine.max_model_len
    assert load_config(prepare_lib.PrepareConfig, recipe, [], section="prepare").preset == "qwen2.5_7b"
    Launcher(str(recipe), [])  # no GPU here: no plan, the launcher's checks pass


@pytest.mark.parametrize("new_tokens", [256, 2048])
def test_the_full_recipe_fits_an_80_gb_gpu_and_needs_more_than_128_gib_of_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_tokens: int
) -> None:
    lengths = [
        f"--coordinator.sampling.max_new_tokens={new_tokens}",
        f"--rollout.engine.max_model_len={new_tokens + 32}",
    ]
    monkeypatch.setattr(gpu_plan, "host_memory_gib", lambda: 1007.0)
    plans, refusal = plan_of(RECIPES / "gpu_7b_full.toml", tmp_path, *lengths)
    assert refusal is None, refusal
    assert plans[0].peak[1] < 78.2
    monkeypatch.setattr(gpu_plan, "host_memory_gib", lambda: 125.8)  # the one-H100 machine here
    _, refusal = plan_of(RECIPES / "gpu_7b_full.toml", tmp_path, *lengths)
    assert refusal is not None and refusal.startswith("host memory")


def test_the_lora_recipe_reads_in_every_service_and_fits_the_one_h100_machine_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = RECIPES / "gpu_7b_lora.toml"
    rollout = load_config(RolloutConfig, recipe, [], section="rollout")
    learner = load_config(LearnerConfig, recipe, [], section="learner")
    load_config(CoordinatorConfig, recipe, [], section="coordinator")
    load_config(RewardServiceConfig, recipe, [], section="reward")
    assert learner.lora is not None and learner.lora.sync == "adapter"
    assert rollout.engine.max_lora_rank is not None and rollout.engine.max_lora_rank >= learner.lora.rank
    Launcher(str(recipe), [])
    monkeypatch.setattr(gpu_plan, "host_memory_gib", lambda: 125.8)
    for new_tokens in (256, 2048):
        lengths = [
            f"--coordinator.sampling.max_new_tokens={new_tokens}",
            f"--rollout.engine.max_model_len={new_tokens + 32}",
        ]
        plans, refusal = plan_of(recipe, tmp_path, *lengths)
        assert refusal is None, refusal
        terms = {t.name: t.gib for t in plans[0].terms}
        assert terms["learner CUDA IPC weight buffers"] < 0.2  # the adapter alone travels (two buffer sets of it)
