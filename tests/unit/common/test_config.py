"""Config loading: recipe + env + CLI overrides; unknown keys and bad values fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.common.config import apply_overrides, load_config
from streamrl.common.errors import ConfigError
from streamrl.coordinator.config import CoordinatorConfig
from streamrl.learner.rl.config import LearnerConfig

RECIPES = sorted((Path(__file__).parents[3] / "recipes").glob("*.toml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.toml"
    path.write_text(text)
    return path


BASE = """
run_id = "x"
total_steps = 7
[coordinator.dataset]
path = "d.jsonl"
tokenizer = "t"
[learner]
model = "m"
"""


def test_section_plus_shared_top_level_fields(tmp_path: Path) -> None:
    cfg = load_config(CoordinatorConfig, write(tmp_path, BASE), section="coordinator")
    assert cfg.run_id == "x" and cfg.total_steps == 7 and cfg.dataset.path == "d.jsonl"
    learner = load_config(LearnerConfig, write(tmp_path, BASE), section="learner")
    assert learner.total_steps == 7 and learner.model == "m"


def test_cli_and_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMRL_COORDINATOR__GROUP_SIZE", "3")
    monkeypatch.setenv("STREAMRL_RUN_ID", "from-env")
    cfg = load_config(
        CoordinatorConfig,
        write(tmp_path, BASE),
        ["--coordinator.max_staleness=2", "--redis.url=redis://h:1/0"],
        section="coordinator",
    )
    assert (cfg.group_size, cfg.max_staleness, cfg.redis.url, cfg.run_id) == (3, 2, "redis://h:1/0", "from-env")
    # the command line wins over the environment
    cfg = load_config(CoordinatorConfig, write(tmp_path, BASE), ["--coordinator.group_size=5"], section="coordinator")
    assert cfg.group_size == 5


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("--coordinator.group_sise=4", "group_sise"),
        ("--coordinator.group_size=0", "group_size"),
        ("--coordinator.max_staleness=-1", "max_staleness"),
        ("--coordinator.sampling.temperature=hot", "sampling.temperature"),
        ("--consumer.max_deliveries=0", "consumer.max_deliveries"),
        ("--consumer.block_ms=10000", "consumer.block_ms"),  # would outlast the client's socket timeout
    ],
)
def test_bad_values_fail_naming_the_field(tmp_path: Path, override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(CoordinatorConfig, write(tmp_path, BASE), [override], section="coordinator")


def test_cross_field_rule(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dynamic_filtering needs group_size >= 2"):
        load_config(
            CoordinatorConfig,
            write(tmp_path, BASE),
            ["--coordinator.dynamic_filtering=true", "--coordinator.group_size=1"],
            section="coordinator",
        )


def test_malformed_override_and_recipe(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        apply_overrides({}, ["--no-equals-sign"], env={})
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(CoordinatorConfig, write(tmp_path, "[[["), section="coordinator")
    with pytest.raises(ConfigError, match="recipe not found"):
        load_config(CoordinatorConfig, tmp_path / "missing.toml", section="coordinator")


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_service_recipe_parses(recipe: Path) -> None:
    from streamrl.common.config import read_recipe
    from streamrl.ops.up_config import UpConfig
    from streamrl.reward.__main__ import RewardServiceConfig
    from streamrl.rollout.config import RolloutConfig

    data = read_recipe(recipe)
    if "coordinator" not in data:
        pytest.skip("not a service recipe (offline job)")
    for cls, section in (
        (CoordinatorConfig, "coordinator"),
        (LearnerConfig, "learner"),
        (RolloutConfig, "rollout"),
        (RewardServiceConfig, "reward"),
    ):
        load_config(cls, recipe, section=section)
    UpConfig.model_validate(data.get("up", {}))


SCORERS = {
    "reward": {
        "scorers": [
            {"type": "http", "name": "rm", "urls": ["http://rm:5000/get_reward"]},
            {"type": "function", "name": "fmt", "path": "f.py"},
        ]
    }
}


def test_numeric_segment_indexes_a_list_from_cli_and_env() -> None:
    data = apply_overrides(
        SCORERS, ["--reward.scorers.1.weight=0.5"], env={"STREAMRL_REWARD__SCORERS__0__TOKEN_ENV": "T"}
    )
    assert data["reward"]["scorers"][0]["token_env"] == "T"
    assert data["reward"]["scorers"][1]["weight"] == 0.5
    assert SCORERS["reward"]["scorers"][0].get("token_env") is None  # the input is not modified
    # a whole item can be replaced; on a dict a numeric segment stays a key
    item = '{"type": "function", "name": "g", "path": "g.py"}'
    data = apply_overrides({**SCORERS, "a": {}}, [f"--reward.scorers.1={item}", "--a.0=x"], env={})
    assert data["reward"]["scorers"][1]["name"] == "g" and data["a"] == {"0": "x"}


@pytest.mark.parametrize("override", ["--reward.scorers.2.weight=1", "--reward.scorers.2=1"])
def test_index_past_the_end_of_a_list_is_refused(override: str) -> None:
    with pytest.raises(ConfigError, match=r"reward\.scorers\.2.*2 items"):
        apply_overrides(SCORERS, [override], env={})
    with pytest.raises(ConfigError, match=r"reward\.scorers\.name.*list"):
        apply_overrides(SCORERS, ["--reward.scorers.name=x"], env={})


def test_scorer_item_override_validates(tmp_path: Path) -> None:
    from streamrl.reward.config import HttpScorerConfig, RewardConfig

    recipe = write(tmp_path, '[[reward.scorers]]\ntype = "http"\nname = "rm"\nurls = ["http://rm:5000/get_reward"]\n')
    cfg = load_config(RewardConfig, recipe, ["--reward.scorers.0.token_env=MY_TOKEN"], section="reward")
    assert isinstance(cfg.scorers[0], HttpScorerConfig) and cfg.scorers[0].token_env == "MY_TOKEN"
