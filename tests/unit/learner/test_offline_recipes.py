"""Every offline-job recipe in recipes/ parses into its config class (no torch needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.common.config import load_config
from streamrl.learner.offline.config import DPOConfig, RMConfig, SFTConfig

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
JOBS = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig}


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.toml") if p.name.split("_")[0] in JOBS))
def test_offline_recipe_parses(recipe: str) -> None:
    cls = JOBS[recipe.split("_")[0]]
    cfg = load_config(cls, RECIPES / recipe, [])
    assert cfg.train.run_dir.startswith("runs/")


def test_there_is_a_recipe_per_job() -> None:
    assert {p.name.split("_")[0] for p in RECIPES.glob("*.toml")} >= set(JOBS)
