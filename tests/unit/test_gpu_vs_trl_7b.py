"""bench/gpu_vs_trl_7b.py's pure parts without a GPU: both sides' settings in one vocabulary and the refusal
naming a setting that differs, the step times of each side's records, the median and wall figures, the
ratios. The whole harness on a CPU is ``python bench/gpu_vs_trl_7b.py --smoke`` (about 2 minutes)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_vs_trl_7b as bench  # noqa: E402


def resolved(**changes: Any) -> dict[str, Any]:
    """What ``streamrl up recipes/gpu_7b_lora.toml --dry-run`` prints, cut to the fields the bench reads
    (the real dry run: tests/integration/test_gpu_vs_trl_7b_settings.py)."""
    out: dict[str, Any] = {
        "coordinator": {
            "prompts_per_step": 32,
            "group_size": 8,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 256},
        },
        "rollout": {
            "engine": {
                "type": "vllm",
                "model": "runs/gpu_7b_data/model",
                "max_model_len": 288,
                "gpu_memory_utilization": 0.45,
                "max_num_seqs": 256,
                "device": "auto",
            }
        },
        "learner": {
            "model": "runs/gpu_7b_data/model",
            "mini_batches": 1,
            "ppo_epochs": 1,
            "checkpoint_every": 10,
            "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
            "ds": {
                "dtype": "bf16",
                "seed": 42,
                "lr": 1e-5,
                "scheduler": "constant",
                "warmup_steps": 0,
                "torch_adam": True,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.0,
                "grad_clip": 1.0,
                "micro_batch_size": 16,
                "grad_accum": 16,
                "gradient_checkpointing": True,
            },
            "algo": {
                "kl": {"placement": "none", "coef": 0.01},
                "loss": {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "aggregation": "token-mean"},
                "advantage": {"estimator": "grpo"},
            },
        },
    }
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        node = out
        for key in path:
            node = node[key]
        node[last] = value
    return out


@pytest.fixture
def recipe_settings() -> dict[str, Any]:
    return bench.ours_settings(resolved(), steps=30)


def test_ours_settings_read_the_resolved_configs(recipe_settings: dict[str, Any]) -> None:
    s = recipe_settings
    assert set(s) == set(bench.PARITY_FIELDS)
    assert (s["lora_rank"], s["lora_alpha"], s["lora_target_modules"]) == (16, 32.0, "all-linear")
    assert (s["prompts_per_step"], s["group_size"], s["max_new_tokens"], s["max_model_len"]) == (32, 8, 256, 288)
    assert (s["micro_batch_size"], s["grad_accum"], s["updates_per_step"]) == (16, 16, 1)
    assert (s["dtype"], s["device"], s["vllm"], s["gpu_memory_utilization"]) == ("bfloat16", "cuda", True, 0.45)
    assert (s["kl_coef"], s["steps"], s["model"]) == (0.0, 30, str((Path.cwd() / "runs/gpu_7b_data/model").resolve()))
    listed = bench.ours_settings(
        resolved(learner__lora={"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["v_proj", "q_proj"]}),
        steps=30,
    )
    assert listed["lora_target_modules"] == ["q_proj", "v_proj"]
    cpu = bench.ours_settings(resolved(rollout__engine__type="hf", rollout__engine__device="cpu"), steps=8)
    assert (cpu["vllm"], cpu["gpu_memory_utilization"], cpu["device"]) == (False, None, "cpu")


def test_ours_settings_refuse_two_models() -> None:
    with pytest.raises(ValueError, match=r"rollout\.engine\.model"):
        bench.ours_settings(resolved(rollout__engine__model="elsewhere"), steps=30)


def test_parity_passes_equal_settings_and_names_each_difference(recipe_settings: dict[str, Any]) -> None:
    ours = recipe_settings
    bench.check_parity(ours, copy.deepcopy(ours))
    theirs = {**ours, "lora_rank": 8, "lr": 2e-5, "betas": [0.9, 0.999]}
    with pytest.raises(ValueError, match="refusing to run") as error:
        bench.check_parity(ours, theirs)
    for name in ("lora_rank: streamrl 16 vs TRL 8", "lr: streamrl 1e-05 vs TRL 2e-05", "betas"):
        assert name in str(error.value)
    assert "group_size" not in str(error.value)


def test_parity_tolerates_float_rounding_but_not_a_missing_setting(recipe_settings: dict[str, Any]) -> None:
    ours = recipe_settings
    assert bench.parity_errors(ours, {**ours, "lr": 1e-5 * (1 + 1e-15)}) == []
    missing = {k: v for k, v in ours.items() if k != "grad_accum"}
    assert bench.parity_errors(ours, missing) == ["grad_accum: streamrl 16 vs TRL None"]


def test_without_vllm_the_engine_only_settings_are_not_compared(recipe_settings: dict[str, Any]) -> None:
    ours = {**recipe_settings, "vllm": False, "gpu_memory_utilization": None, "max_num_seqs": None}
    theirs = {**ours, "max_model_len": 4096, "gpu_memory_utilization": 0.9, "max_num_seqs": 64}
    assert bench.parity_errors(ours, theirs) == []


def test_our_step_ends_take_the_learner_rows_only() -> None:
    rows = [
        {"step": 0, "time": 5.0, "coordinator/batch_samples": 256},
        {"step": 1, "time": 10.0, "learner/step_s": 2.0},
        {"step": 2, "time": 13.0, "learner/step_s": 2.0},
    ]
    assert bench.our_step_ends(rows) == {1: 10.0, 2: 13.0}


def test_trl_events_give_step_ends_and_saves() -> None:
    events = [
        {"event": "train_begin", "time": 1.0},
        {"event": "step", "step": 1, "time": 4.0, "generated_tokens": 10},
        {"event": "step", "step": 2, "time": 6.0, "generated_tokens": 20},
        {"event": "save", "step": 2, "time": 7.0},
        {"event": "saved", "step": 2, "time": 9.0, "generated_tokens": 20},
    ]
    assert bench.trl_step_ends(events) == ({1: 4.0, 2: 6.0}, {2: 9.0})


def test_step_stats_median_after_warmup_and_wall_with_saves() -> None:
    ends = {1: 20.0, 2: 22.0, 3: 24.0, 4: 27.0, 5: 30.0, 6: 32.0}
    saves = {3: 25.0, 6: 40.0}  # step 3's checkpoint ends at 25: step 4 takes 27 - 25
    stats = bench.step_stats(ends, launched=0.0, warmup=2, wall_step=6, min_measured=4, saves=saves)
    assert stats["step_s"] == {"3": 2.0, "4": 2.0, "5": 3.0, "6": 2.0}
    assert stats["s_per_step_median"] == 2.0
    assert (stats["num_measured"], stats["enough"], stats["measured_steps"]) == (4, True, [3, 6])
    assert stats["launch_to_first_step_s"] == 20.0
    assert stats["wall_to_step_6_s"] == 40.0  # the last step's save counts
    short = bench.step_stats(ends, launched=0.0, warmup=2, wall_step=30, min_measured=20)
    assert short["enough"] is False and short["wall_to_step_30_s"] is None


def test_ratios_are_trl_over_streamrl() -> None:
    ours = {"s_per_step_median": 2.0, "wall_to_step_30_s": 100.0}
    theirs = {"s_per_step_median": 5.0, "wall_to_step_30_s": 250.0}
    assert bench.ratios(ours, theirs, 30) == {"per_step_ratio": 2.5, "wall_ratio": 2.5}
    assert bench.ratios(ours, {"s_per_step_median": None}, 30) == {"per_step_ratio": None, "wall_ratio": None}


def test_args_refuse_too_few_measured_steps() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "20"])  # 5 warm-up steps leave 15 < 20
    args = bench.parse_args(["--smoke"])
    assert (args.steps, args.warmup_steps, args.min_measured, args.wall_step) == (8, 2, 3, 8)
    args = bench.parse_args([])
    assert (args.steps, args.warmup_steps, args.min_measured, args.wall_step) == (30, 5, 20, 30)


def one_side(side: str, settings: dict[str, Any], **figures: Any) -> dict[str, Any]:
    other = "trl" if side == "streamrl" else "streamrl"
    return {
        "date": f"{side}-date",
        "machine": {"gpus": ["0, NVIDIA H100 80GB HBM3"]},
        "settings": {"streamrl": settings},
        side: {"s_per_step_median": 2.0, "wall_to_step_30_s": 100.0, **figures},
        other: None,
        "errors": [],
    }


def test_combine_joins_one_side_each_and_refuses_other_settings(recipe_settings: dict[str, Any]) -> None:
    ours = one_side("streamrl", recipe_settings)
    theirs = one_side("trl", recipe_settings, s_per_step_median=6.0, wall_to_step_30_s=150.0)
    joined = bench.combine([ours, theirs])
    assert (joined["per_step_ratio"], joined["wall_ratio"]) == (3.0, 1.5)
    assert joined["combined_from"] == ["streamrl-date", "trl-date"]
    with pytest.raises(ValueError, match="lora_rank"):
        bench.combine([ours, one_side("trl", {**recipe_settings, "lora_rank": 8})])
    elsewhere = {**theirs, "machine": {"gpus": ["0, NVIDIA H200"]}}
    with pytest.raises(ValueError, match="not the same GPUs"):
        bench.combine([ours, elsewhere])


def test_gpu_7b_reads_update_bytes_and_wake_times_from_the_log() -> None:
    import gpu_7b

    log = "\n".join(
        [
            "rollout | opened a CUDA IPC weight buffer of 80740352 bytes",
            "rollout | engine awake for policy version 2 (412 ms)",
            "rollout | engine awake for policy version 3 (388 ms)",
            "rollout | engine awake for policy version 4 (1203 ms)",
        ]
    )
    figures = gpu_7b.log_figures(log)
    assert (figures["bytes_per_update"], figures["ipc_buffers"]) == (80_740_352, 1)
    assert (figures["wake_ms_median"], figures["wake_ms_max"], figures["wakes"]) == (412.0, 1203.0, 3)
    assert gpu_7b.log_figures("nothing")["bytes_per_update"] is None
