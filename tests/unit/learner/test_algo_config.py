"""AlgoConfig: defaults, rejected combinations, group-size check."""

from __future__ import annotations

import pytest

from streamrl.learner.rl.algo.config import AlgoConfig


def test_defaults() -> None:
    cfg = AlgoConfig()
    assert cfg.advantage.estimator == "grpo" and cfg.advantage.grpo_eps == 1e-6
    assert (cfg.loss.clip_eps_low, cfg.loss.clip_eps_high, cfg.loss.aggregation) == (0.2, 0.2, "token-mean")
    assert (cfg.correction.low, cfg.correction.high, cfg.correction.gate_delta) == (0.5, 5.0, 5e-3)
    assert (cfg.kl.placement, cfg.kl.estimator, cfg.kl.coef, cfg.kl.horizon) == ("none", "k1", 0.01, 10_000)
    assert cfg.shaping.reward_clip == (-10.0, 10.0)
    assert not cfg.uses_critic and not cfg.needs_reference and not cfg.needs_behaviour_logprobs


def test_valid_recipes() -> None:
    gae = AlgoConfig.model_validate({"advantage": {"estimator": "gae", "lam": 0.95}, "critic": {"value_clip": 0.2}})
    assert gae.uses_critic and gae.critic is not None and gae.critic.value_clip == 0.2
    dr = AlgoConfig.model_validate(
        {
            "advantage": {"estimator": "dr_grpo"},
            "loss": {"aggregation": "seq-mean-token-sum-norm", "norm_constant": 4096},
        }
    )
    assert dr.loss.norm_constant == 4096
    flash = AlgoConfig.model_validate(
        {
            "advantage": {"estimator": "flash_reinforce"},
            "correction": {"type": "trust_gate", "gate_delta": 3e-3},
            "loss": {"aggregation": "seq-mean-token-mean"},
        }
    )
    assert flash.needs_behaviour_logprobs
    adaptive = AlgoConfig.model_validate({"kl": {"placement": "reward", "target": 0.1}})
    assert adaptive.needs_reference
    assert not AlgoConfig.model_validate({"kl": {"placement": "reward", "coef": 0.0}}).needs_reference


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"advantage": {"estimator": "gae"}}, "needs a critic"),
        ({"critic": {}}, "uses no critic"),
        ({"advantage": {"gamma": 0.9}}, "gamma"),
        ({"advantage": {"estimator": "reinforce", "lam": 0.9}}, "only gae uses lambda"),
        ({"kl": {"placement": "loss", "estimator": "k1"}}, "k1 as a loss"),
        ({"kl": {"placement": "loss", "estimator": "k3", "target": 0.1}}, "adaptive KL"),
        ({"loss": {"aggregation": "seq-mean-token-sum-norm"}}, "norm_constant"),
        ({"loss": {"norm_constant": 100}}, "norm_constant"),
        ({"loss": {"dual_clip": 1.0}}, "greater than 1"),
        ({"correction": {"type": "icepop", "low": 5.0, "high": 2.0}}, "low < high"),
        ({"shaping": {"reward_clip": [1.0, -1.0]}}, "reward_clip"),
        ({"shaping": {"overlong_buffer_len": 10}}, "max_response_len"),
        ({"shaping": {"overlong_buffer_len": 10, "max_response_len": 5}}, "must not exceed"),
        ({"advantage": {"estimator": "ppo"}}, "estimator"),
        ({"advantage": {"bogus": 1}}, "Extra inputs"),
    ],
)
def test_rejected(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AlgoConfig.model_validate(data)


def test_check_group_size() -> None:
    for estimator in ("grpo", "rloo", "dr_grpo", "reinforce_baseline"):
        cfg = AlgoConfig.model_validate({"advantage": {"estimator": estimator}})
        cfg.check_group_size(2)
        with pytest.raises(ValueError, match="needs >= 2 samples"):
            cfg.check_group_size(1)
    for estimator in ("reinforce", "flash_reinforce"):
        AlgoConfig.model_validate({"advantage": {"estimator": estimator}}).check_group_size(1)
    with pytest.raises(ValueError, match=">= 1"):
        AlgoConfig().check_group_size(0)
