"""The GPU memory plan: a 7B-shaped policy's terms, what fits an 80 GB GPU, and the refusal naming the setting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from streamrl.ops import gpu_plan
from streamrl.ops.gpu_plan import GIB, lora_params, plan_run, read_shape, shape_from_config

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


@pytest.fixture(autouse=True)
def host_512_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_plan, "host_memory_gib", lambda: 512.0)


@pytest.fixture
def model_7b(tmp_path: Path) -> str:
    folder = tmp_path / "qwen7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN25_7B))
    return str(folder)


def recipe(model: str, utilization: float = 0.3, **learner_ds: Any) -> dict[str, Any]:
    return {
        "up": {"gpus": {"learner": "0", "rollout": "0"}, "gpu_memory_gib": 79.2},
        "rollout": {
            "engine": {
                "type": "vllm",
                "model": model,
                "max_model_len": 2304,
                "gpu_memory_utilization": utilization,
                "sleep_between_versions": True,
            }
        },
        "learner": {
            "model": model,
            "weights_transport": "ipc",
            "ds": {"zero_stage": 3, "micro_batch_size": 2, "gradient_checkpointing": True, **learner_ds},
        },
    }


def test_the_7b_shape_counts_qwen25_7b_parameters() -> None:
    shape = shape_from_config(QWEN25_7B)
    assert shape.params == pytest.approx(7.62e9, rel=0.01)  # Qwen2.5-7B: 7.61B parameters
    assert shape.kv_dim == 512
    # rank-16 adapters on every linear layer of the 28 blocks: ~40M trainable, 0.5% of the model
    assert lora_params(shape, 16, "all-linear") == 28 * 16 * (
        2 * (3584 + 3584) + 2 * (3584 + 512) + 2 * (3584 + 18944) + (18944 + 3584)
    )
    assert lora_params(shape, 16, ["q_proj", "v_proj"]) == 28 * 16 * (3584 + 3584 + 3584 + 512)


def test_full_parameters_without_offload_are_refused_naming_the_optimizer(model_7b: str) -> None:
    plans, refusal = plan_run(recipe(model_7b))
    assert refusal is not None
    assert "learner.ds.offload_optimizer" in refusal  # AdamW states of 7.6B parameters: 85 GiB
    terms = {t.name: t.gib for t in plans[0].terms}
    assert terms["learner optimizer (AdamW)"] == pytest.approx(7.62e9 * 12 / GIB, rel=0.01)


def test_full_parameters_with_the_optimizer_on_the_host_fit_80_gb_with_one_ipc_buffer_set(model_7b: str) -> None:
    data = recipe(model_7b, offload_optimizer=True)
    _, refusal = plan_run(data)  # two IPC buffer sets (the default): 14 GiB more than one
    assert (
        refusal is not None and "learner CUDA IPC weight buffers 28.4 GiB (learner.weights_ipc_buffer_sets)" in refusal
    )
    data["learner"]["weights_ipc_buffer_sets"] = 1
    plans, refusal = plan_run(data)
    assert refusal is None, refusal
    plan = plans[0]
    assert plan.peak[1] < 79.2 - 1.0
    assert "(on host)" in plan.render()
    # vLLM sleeps while the learner trains: its share counts only while generating
    assert plan.peak_gib("train") < plan.peak_gib("generate")


def test_lora_fits_without_offload_and_its_ipc_buffers_hold_only_the_adapters(model_7b: str) -> None:
    data = recipe(model_7b, utilization=0.45)
    data["learner"]["lora"] = {"rank": 16, "target_modules": "all-linear"}
    plans, refusal = plan_run(data)
    assert refusal is None, refusal
    terms = {t.name: t.gib for t in plans[0].terms}
    assert terms["learner optimizer (AdamW)"] < 1.0
    assert terms["learner CUDA IPC weight buffers"] < 0.2 and terms["engine CUDA IPC staging copy"] < 0.1  # 2 sets
    data["learner"]["lora"]["sync"] = "merged"  # merged weights travel whole
    plans, _ = plan_run(data)
    assert {t.name: t.gib for t in plans[0].terms}["learner CUDA IPC weight buffers"] > 14


def test_an_engine_share_too_large_for_what_the_learner_holds_names_gpu_memory_utilization(model_7b: str) -> None:
    _, refusal = plan_run(recipe(model_7b, utilization=0.45, offload_optimizer=True))  # + the IPC copies
    assert refusal is not None and "rollout.engine.gpu_memory_utilization" in refusal


def test_no_gpu_placement_or_unreadable_model_gives_no_plan(tmp_path: Path) -> None:
    data = recipe(str(tmp_path / "missing"))
    assert plan_run(data) == ([], None)
    del data["up"]["gpus"]
    assert plan_run(data) == ([], None)
    assert read_shape(str(tmp_path / "missing")) is None


def test_the_check_can_be_turned_off(model_7b: str) -> None:
    data = recipe(model_7b)
    data["up"]["gpu_plan_check"] = False
    plans, refusal = plan_run(data)
    assert refusal is None and not plans[0].fits()


def test_full_parameters_offloaded_are_refused_on_a_host_of_128_gib(
    model_7b: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # AdamW states and fp32 gradients of 7.6B parameters (114 GiB) and the sleeping engine's weights (14 GiB)
    monkeypatch.setattr(gpu_plan, "host_memory_gib", lambda: 125.8)
    plans, refusal = plan_run(recipe(model_7b, offload_optimizer=True))
    assert refusal is not None and refusal.startswith("host memory") and "learner.lora" in refusal
    assert "host memory (125.8 GiB)" in plans[0].render()
