"""recipes/gpu_qwen2_0.5b.toml validates in every service and the launcher, colocated and with the
documented separate-GPU overrides; its prepare table selects the Qwen2 preset."""

from __future__ import annotations

from pathlib import Path

import prepare as prepare_lib
import pytest

from streamrl.common.config import load_config
from streamrl.coordinator.config import CoordinatorConfig
from streamrl.learner.rl.config import LearnerConfig
from streamrl.ops.launcher import Launcher
from streamrl.reward.__main__ import RewardServiceConfig
from streamrl.rollout.config import RolloutConfig

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gpu_qwen2_0.5b.toml"
SEPARATE = ['--up.gpus={"rollout": "1", "learner": "0"}', "--learner.weights_transport=zmq"]
"""The recipe's header: rollout on GPU 1, learner on GPU 0, weights over ZMQ."""


def test_services_read_the_colocated_recipe() -> None:
    coordinator = load_config(CoordinatorConfig, RECIPE, [], section="coordinator")
    rollout = load_config(RolloutConfig, RECIPE, [], section="rollout")
    learner = load_config(LearnerConfig, RECIPE, [], section="learner")
    load_config(RewardServiceConfig, RECIPE, [], section="reward")
    assert (coordinator.prompts_per_step, coordinator.group_size, coordinator.max_staleness) == (32, 8, 1)
    assert coordinator.eval.dataset is None  # evaluation off
    assert (rollout.engine.type, rollout.engine.device, rollout.engine.dtype) == ("hf", "cuda", "bfloat16")
    assert rollout.engine.max_num_seqs >= coordinator.prompts_per_step * coordinator.group_size
    assert coordinator.sampling.max_new_tokens + 10 <= rollout.engine.max_model_len
    assert (learner.weights_transport, learner.ds.dtype, learner.ds.compile) == ("ipc", "bf16", False)
    assert learner.checkpoint_every > learner.total_steps
    launcher = Launcher(str(RECIPE), [])
    assert launcher.cfg.up.cuda_devices("rollout", 0) == launcher.cfg.up.cuda_devices("learner", 0) == "0"


def test_separate_gpus_as_documented_overrides() -> None:
    launcher = Launcher(str(RECIPE), SEPARATE)
    assert (launcher.cfg.up.cuda_devices("rollout", 0), launcher.cfg.up.cuda_devices("learner", 0)) == ("1", "0")
    assert load_config(LearnerConfig, RECIPE, SEPARATE, section="learner").weights_transport == "zmq"
    assert SEPARATE[0] in RECIPE.read_text().replace("\\\n", "")


@pytest.mark.parametrize("overrides", [[], ["--prepare.preset=qwen2_tiny"]])
def test_prepare_table_selects_a_qwen2_preset(overrides: list[str]) -> None:
    config = load_config(prepare_lib.PrepareConfig, RECIPE, overrides, section="prepare")
    assert config.preset in {"qwen2_0.5b", "qwen2_tiny"} and config.out_dir == "runs/gpu_qwen2_data"
