"""DPO / IPO job on a tiny Qwen2: the held-out implicit-reward margin rises; live and precomputed references agree."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from streamrl.learner.offline.config import DPOConfig
from streamrl.learner.offline.dpo import run_dpo


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_raises_held_out_margin(kit: SimpleNamespace, tiny_qwen_dir: Path, tmp_path: Path, loss_type: str) -> None:
    train = kit.write_jsonl(tmp_path / "train.jsonl", kit.preference_records(96, seed=0))
    held = kit.write_jsonl(tmp_path / "eval.jsonl", kit.preference_records(32, seed=1))
    recipe = kit.recipe(
        tmp_path / "run",
        tiny_qwen_dir,
        train,
        held,
        train={"epochs": 1, "save_best": False},
        deepspeed={"lr": 1e-3},
        beta=0.1,
        loss_type=loss_type,
    )
    result = run_dpo(DPOConfig.model_validate(recipe))
    final = result.evals[-1]
    # the policy starts equal to the reference: margin 0 before training
    assert final["margin"] > 0.2, result.evals  # IPO pulls beta * z towards 0.5
    assert final["accuracy"] >= 0.9
    assert final["chosen_reward"] > final["rejected_reward"]


def test_live_reference_matches_precomputed(kit: SimpleNamespace, tiny_qwen_dir: Path, tmp_path: Path) -> None:
    train = kit.write_jsonl(tmp_path / "train.jsonl", kit.preference_records(16, seed=0))
    runs = []
    for precompute in (True, False):
        recipe = kit.recipe(
            tmp_path / f"run_{precompute}",
            tiny_qwen_dir,
            train,
            None,
            train={"max_steps": 2, "save_best": False, "export": False},
            precompute_ref=precompute,
            label_smoothing=0.1,
            nll_coef=0.5,
        )
        runs.append(run_dpo(DPOConfig.model_validate(recipe)).history)
    for a, b in zip(*runs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["margin"] == pytest.approx(b["margin"], abs=1e-5)
