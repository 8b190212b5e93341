"""bench/gpu_vs_trl_7b.py's settings parity on the real configs: ``streamrl up --dry-run`` of
recipes/gpu_7b_lora.toml (as the GPU run and the CPU smoke override it) and the GRPOConfig / LoraConfig the
TRL script builds from those settings agree on every compared field (no model is loaded on either side)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_vs_trl_7b as bench  # noqa: E402

OFF_PLAN = ["--up.gpu_plan_check=false"]  # no model folder here: the GPU memory plan reads its config.json


def test_the_call_size_keeps_the_recipe_but_its_batch(tmp_path: Path) -> None:
    recipe = bench.ours_settings(bench.dry_run_ours(str(bench.RECIPE), OFF_PLAN, "cuda"), steps=30)
    call = bench.ours_settings(bench.dry_run_ours(str(bench.RECIPE), [*bench.CALL_OVERRIDES, *OFF_PLAN], "cuda"), 30)
    assert (recipe["prompts_per_step"], recipe["max_new_tokens"], recipe["max_model_len"]) == (32, 256, 288)
    assert (call["prompts_per_step"], call["max_new_tokens"], call["max_model_len"]) == (8, 128, 160)
    for s in (recipe, call):  # one optimizer step per batch, and vLLM decodes the batch at once (as TRL's)
        assert s["micro_batch_size"] * s["grad_accum"] == s["prompts_per_step"] * s["group_size"] == s["max_num_seqs"]
    changed = {k for k in bench.PARITY_FIELDS if recipe[k] != call[k]}
    assert changed == {"prompts_per_step", "max_new_tokens", "max_model_len", "grad_accum", "max_num_seqs"}


def test_smoke_settings_are_the_same_on_both_sides(tmp_path: Path) -> None:
    ours = bench.ours_settings(bench.dry_run_ours(str(bench.RECIPE), bench.SMOKE_OVERRIDES, "cpu"), steps=8)
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps(bench.trl_input(ours, str(tmp_path / "data"), str(tmp_path / "trl"))))
    theirs = bench.dry_run_trl(settings, "cpu")
    assert bench.parity_errors(ours, theirs) == []
    assert (theirs["vllm"], theirs["lora_rank"], theirs["grad_accum"], theirs["steps"]) == (False, 8, 2, 8)
    settings.write_text(json.dumps(bench.trl_input({**ours, "loss_aggregation": "seq-mean-token-mean"}, "d", "o")))
    assert bench.parity_errors(ours, bench.dry_run_trl(settings, "cpu")) == [
        "loss_aggregation: streamrl 'token-mean' vs TRL 'seq-mean-token-mean'"
    ]
