"""``AlgoConfig``: the RL algorithm chosen by name, with the reference defaults; validated at start.

Imports no torch, so the coordinator and the launcher can validate a recipe's ``[algo]`` section
without the learner's dependencies. Sections: ``advantage`` (estimator, gamma, lambda), ``kl``
(estimator, placement, coefficient, adaptive target), ``loss`` (policy loss, clip bounds, dual clip,
aggregation, entropy), ``critic`` (present only for GAE), ``correction`` (engine-vs-trainer
off-policy correction), ``shaping`` (scalar reward shaping). The option table with formula
references and the formulas is ``docs/algorithms.md``.

Cross-field rules reject combinations that cannot work or settings that would be silently ignored
(e.g. GAE without a critic, a lambda with a critic-free estimator, k1 as a loss). The group size is
known only to the coordinator, so it is checked with ``check_group_size(n)``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from streamrl.common.config import BaseConfig

Estimator = Literal["gae", "reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "flash_reinforce"]
GROUP_ESTIMATORS: frozenset[str] = frozenset({"reinforce_baseline", "rloo", "grpo", "dr_grpo"})
"""Estimators whose baseline is taken over the samples of one prompt: they need groups of >= 2."""
WHITENED_ESTIMATORS: frozenset[str] = frozenset({"gae", "reinforce", "reinforce_baseline"})
"""Estimators whose advantages are whitened over the whole batch."""


class AdvantageConfig(BaseConfig):
    """How advantages are estimated (algorithms.md section 1)."""

    estimator: Estimator = "grpo"
    """gae | reinforce (REINFORCE++) | reinforce_baseline | rloo | grpo | dr_grpo | flash_reinforce."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount; only gae and reinforce use it (the group estimators force 1)."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda; only gae uses it."""
    grpo_eps: float = Field(1e-6, gt=0.0)
    """GRPO's ``eps`` in ``(R - mean) / (std_unbiased + eps)`` (verl's value)."""
    std_normalize: bool = True
    """Divide by the std in the global whitening of gae / reinforce / reinforce_baseline; False only centres."""


class KLConfig(BaseConfig):
    """KL regularisation towards the reference policy (algorithms.md section 2)."""

    placement: Literal["none", "reward", "loss"] = "none"
    """Where the KL goes: none, subtracted per token from the reward, or added to the loss."""
    estimator: Literal["k1", "k2", "k3", "k3+"] = "k1"
    """k1 for the reward; k2 (reverse-KL gradient), k3 or k3+ for the loss (k1 is rejected as a loss)."""
    coef: float = Field(0.01, ge=0.0)
    """Initial coefficient beta (OpenRLHF ``init_coef`` 0.01; GRPO paper 0.04 as a loss)."""
    target: float | None = Field(None, gt=0.0)
    """Adaptive controller target KL (per-sequence token-mean, nats); None keeps beta fixed. Reward only."""
    horizon: int = Field(10_000, ge=1)
    """Adaptive controller horizon (sequences)."""


class LossConfig(BaseConfig):
    """Policy loss and its aggregation (algorithms.md section 3)."""

    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """ppo: token ratio; gspo: sequence geometric-mean ratio (use tiny clip eps, e.g. 3e-4 / 4e-4)."""
    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower clip: ratio >= 1 - eps_low."""
    clip_eps_high: float = Field(0.2, ge=0.0)
    """Upper clip: ratio <= 1 + eps_high (DAPO clip-higher uses 0.28)."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual-clip constant c > 1 for negative advantages (verl applies 3.0); None = off."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses become a scalar; the normaliser is global (all micro-batches and ranks)."""
    norm_constant: float | None = Field(None, gt=0.0)
    """C of seq-mean-token-sum-norm (Dr. GRPO: the maximum response length, tokens); required there only."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus coefficient c_H (0 = off; entropy is still logged when given)."""


class CriticConfig(BaseConfig):
    """Value-function loss, for GAE only (algorithms.md 3.5)."""

    value_clip: float | None = Field(0.5, gt=0.0)
    """Clip range eps_v of ``V - V_old``; None = unclipped squared error."""
    value_coef: float = Field(0.1, gt=0.0)
    """Weight of the value loss when it is added to the policy loss (TRL ``vf_coef``)."""


class CorrectionConfig(BaseConfig):
    """Off-policy correction from the engine's behaviour log-probs (algorithms.md section 4)."""

    type: Literal["none", "tis", "icepop", "seq_mask_tis", "decoupled", "trust_gate"] = "none"
    """none | tis (clamp) | icepop (token mask) | seq_mask_tis (sequence mask) | decoupled | trust_gate (Flash)."""
    low: float | None = Field(0.5, gt=0.0)
    """Lower ratio bound (OpenRLHF 0.5); None = no lower bound. Not used by trust_gate."""
    high: float = Field(5.0, gt=0.0)
    """Upper ratio bound (OpenRLHF 5.0). Not used by trust_gate."""
    gate_metric: Literal["binary_kl", "tv"] = "binary_kl"
    """trust_gate divergence of the sampled token: binary KL or total variation."""
    gate_delta: float = Field(5e-3, gt=0.0)
    """trust_gate threshold delta on the sequence mean divergence (FlashREINFORCE: 5e-3, or 3e-3 / 1e-3)."""


class ShapingConfig(BaseConfig):
    """Scalar reward shaping before baselines (algorithms.md 1.0, 5.2, 5.3)."""

    reward_clip: tuple[float, float] | None = (-10.0, 10.0)
    """Clamp the final reward to [low, high] (OpenRLHF default); None = off."""
    overlong_buffer_len: int | None = Field(None, ge=1)
    """DAPO overlong buffer L_cache (tokens); None = off."""
    overlong_penalty_factor: float = Field(1.0, ge=0.0)
    """DAPO overlong penalty factor."""
    max_response_len: int | None = Field(None, ge=1)
    """L_max of the overlong penalty (tokens): the generation limit."""
    stop_properly_penalty_coef: float | None = None
    """Truncated responses: R <- c R if c >= 0, else R <- c; None = off."""


class AlgoConfig(BaseConfig):
    """The RL algorithm: advantage estimator, KL, loss, critic, off-policy correction, reward shaping."""

    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimator."""
    kl: KLConfig = KLConfig()
    """KL regularisation."""
    loss: LossConfig = LossConfig()
    """Policy loss and aggregation."""
    critic: CriticConfig | None = None
    """Value loss settings; required by gae and rejected by the critic-free estimators."""
    correction: CorrectionConfig = CorrectionConfig()
    """Off-policy correction."""
    shaping: ShapingConfig = ShapingConfig()
    """Reward shaping."""

    @model_validator(mode="after")
    def _check_combinations(self) -> AlgoConfig:
        _check_advantage(self.advantage, self.critic)
        _check_kl(self.kl)
        _check_loss(self.loss)
        _check_correction(self.correction)
        _check_shaping(self.shaping)
        return self

    @property
    def uses_critic(self) -> bool:
        """True for gae: the learner must provide values, old values and returns."""
        return self.advantage.estimator == "gae"

    @property
    def needs_reference(self) -> bool:
        """True when a reference policy's log-probs are needed: a KL term in the reward or the loss with a
        coefficient above 0 (an adaptive coefficient starting at 0 stays 0)."""
        return self.kl.placement != "none" and self.kl.coef > 0

    @property
    def needs_behaviour_logprobs(self) -> bool:
        """True when the engine's behaviour log-probs enter the loss (any correction)."""
        return self.correction.type != "none"

    def check_group_size(self, n: int) -> None:
        """Raise ``ValueError`` if ``n`` samples per prompt cannot work with the chosen estimator."""
        if n < 1:
            raise ValueError(f"group size must be >= 1, got {n}")
        if n < 2 and self.advantage.estimator in GROUP_ESTIMATORS:
            raise ValueError(
                f"advantage.estimator={self.advantage.estimator} uses a group baseline and needs >= 2 samples "
                f"per prompt, got {n}; raise the group size or use reinforce / flash_reinforce"
            )


def _check_advantage(adv: AdvantageConfig, critic: CriticConfig | None) -> None:
    """The estimator against the critic section, gamma and lambda (``ValueError`` on a mismatch)."""
    if adv.estimator == "gae" and critic is None:
        raise ValueError("advantage.estimator=gae needs a critic: set the [algo.critic] section")
    if adv.estimator != "gae" and critic is not None:
        raise ValueError(f"advantage.estimator={adv.estimator} uses no critic; remove the [algo.critic] section")
    if adv.gamma != 1.0 and adv.estimator not in ("gae", "reinforce"):
        raise ValueError(f"advantage.gamma={adv.gamma} has no effect with {adv.estimator} (gamma is 1 there)")
    if adv.lam != 1.0 and adv.estimator != "gae":
        raise ValueError(f"advantage.lam={adv.lam} has no effect with {adv.estimator} (only gae uses lambda)")


def _check_kl(kl: KLConfig) -> None:
    """A KL estimator usable where it is placed; an adaptive target only in the reward."""
    if kl.placement == "loss" and kl.estimator == "k1":
        raise ValueError(
            "kl.estimator=k1 as a loss has zero expected gradient; use k2, k3 or k3+ (or placement=reward)"
        )
    if kl.target is not None and kl.placement != "reward":
        raise ValueError("kl.target (adaptive KL) only applies with kl.placement=reward")


def _check_loss(loss: LossConfig) -> None:
    """``norm_constant`` is set exactly for the aggregation that uses it."""
    if (loss.aggregation == "seq-mean-token-sum-norm") != (loss.norm_constant is not None):
        raise ValueError("loss.norm_constant must be set exactly when loss.aggregation=seq-mean-token-sum-norm")


def _check_correction(corr: CorrectionConfig) -> None:
    """Ratio bounds in order for the corrections that have a lower bound."""
    if corr.type in ("tis", "icepop", "seq_mask_tis", "decoupled") and corr.low is not None and corr.low >= corr.high:
        raise ValueError(f"correction bounds need low < high, got low={corr.low}, high={corr.high}")


def _check_shaping(shaping: ShapingConfig) -> None:
    """A reward clip in order; an overlong buffer within a known generation limit."""
    if shaping.reward_clip is not None and shaping.reward_clip[0] >= shaping.reward_clip[1]:
        raise ValueError(f"shaping.reward_clip needs low < high, got {shaping.reward_clip}")
    if shaping.overlong_buffer_len is not None:
        if shaping.max_response_len is None:
            raise ValueError("shaping.overlong_buffer_len needs shaping.max_response_len (the generation limit)")
        if shaping.overlong_buffer_len > shaping.max_response_len:
            raise ValueError("shaping.overlong_buffer_len must not exceed shaping.max_response_len")
