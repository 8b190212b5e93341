"""RewardConfig validation: discriminated scorer union, bounds, cross-field checks."""

from __future__ import annotations

import pytest

from streamrl.common.config import validate
from streamrl.common.errors import ConfigError
from streamrl.reward.config import (
    FunctionScorerConfig,
    HttpScorerConfig,
    ModelScorerConfig,
    RewardConfig,
)


def test_union_picks_the_type() -> None:
    config = validate(
        RewardConfig,
        {
            "scorers": [
                {"type": "function", "name": "math", "path": "r.py", "weight": 2},
                {
                    "type": "http",
                    "name": "remote",
                    "urls": ["http://rm:5000/get_reward"],
                    "token_env": "RM_TOKEN",
                },
                {"type": "model", "name": "rm", "path": "/models/rm", "weight": 0},
            ],
            "max_wait_ms": 5,
        },
    )
    assert [type(s) for s in config.scorers] == [
        FunctionScorerConfig,
        HttpScorerConfig,
        ModelScorerConfig,
    ]
    assert config.scorers[1].batch_size == 32 and config.scorers[1].load_balancing == "least_loaded"


@pytest.mark.parametrize(
    ("scorers", "message"),
    [
        ([], "scorers: List should have at least 1 item"),
        ([{"type": "soap", "name": "x"}], "does not match any of the expected tags"),
        (
            [{"type": "function", "name": "a", "path": "r.py"}] * 2,
            "names must be unique",
        ),
        (
            [{"type": "function", "name": "a", "path": "r.py", "weight": 0}],
            "at least one scorer needs a weight > 0",
        ),
        ([{"type": "http", "name": "h", "urls": []}], "scorers.0.http.urls"),
        ([{"type": "http", "name": "h", "urls": ["rm:5000"]}], "must start with http"),
        (
            [{"type": "http", "name": "h", "urls": ["http://a"], "backoff_max_s": 0.1}],
            "backoff_max_s",
        ),
        (
            [{"type": "http", "name": "h", "urls": ["http://a"], "timeout": 3}],
            "scorers.0.http.timeout: Extra inputs",
        ),
        (
            [{"type": "model", "name": "m", "path": "p", "batch_size": 0}],
            "scorers.0.model.batch_size",
        ),
    ],
)
def test_bad_config_names_the_field(scorers: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(RewardConfig, {"scorers": scorers})
