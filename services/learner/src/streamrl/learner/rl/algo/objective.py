"""The composition the learner service calls: shaped rewards -> advantages -> scalar training loss.

One learner step, in order::

    rewards    = shape_rewards(cfg, rewards=R, response_lengths=..., truncated=...)      # [B], whole batch
    adv, ret   = compute_advantages(cfg, rewards=rewards, group_index=..., mask=..., kl=..., values=...)
    N          = sum over micro-batches and ranks of losses.normaliser_count(mb_mask, cfg.loss.aggregation)
    for each micro-batch:                                                                 # any split
        loss, metrics = policy_objective(cfg, logprobs=..., ..., normaliser=N)
        loss.backward()

Because every statistic of the advantages is taken over the whole batch and every loss term is
divided by the global ``N``, the sum of the micro-batch losses equals the full-batch loss for every
split (tests check this). A data-parallel backend that averages gradients over ranks (DeepSpeed,
DDP) needs ``normaliser = N / world_size`` (or the loss multiplied by ``world_size``).

The per-token loss is (algorithms.md 4.5)::

    l_t   = sg(w_t) * policy_loss_t          ppo or gspo clipped surrogate (losses), w from correction
    loss  = agg(l) + beta * agg(k(logp_theta, logp_ref))     (kl.placement = loss)
               - c_H * agg(H) + c_V * agg(value_loss)

with rejected tokens (weight 0) kept in the denominator. FlashREINFORCE is the flash_reinforce
estimator + ``correction.type = trust_gate`` + ``loss.aggregation = seq-mean-token-mean`` + one
optimizer step per batch: on that single step ``pi_old = pi_theta``, so the PPO loss has value ``-A``
and gradient ``-A grad logp`` (algorithms.md 1.8, "equivalence used by OpenRLHF").
"""

from __future__ import annotations

import torch
from torch import Tensor

from streamrl.learner.rl.algo import advantages as adv_fns
from streamrl.learner.rl.algo import correction as corr_fns
from streamrl.learner.rl.algo import shaping
from streamrl.learner.rl.algo.config import AdvantageConfig, AlgoConfig, CorrectionConfig, LossConfig
from streamrl.learner.rl.algo.kl import kl_estimate
from streamrl.learner.rl.algo.losses import PolicyLoss, aggregate, gspo_loss, ppo_clip_loss, value_loss


def shape_rewards(
    cfg: AlgoConfig, *, rewards: Tensor, response_lengths: Tensor | None = None, truncated: Tensor | None = None
) -> Tensor:
    """Apply the configured scalar shaping to ``rewards`` [B]: overlong penalty, stop-properly penalty, clip.

    ``response_lengths`` [B] (generated tokens) is required by the overlong penalty and ``truncated``
    [B] (bool, finish reason = length) by the stop-properly penalty. Returns a new [B] tensor.
    """
    s = cfg.shaping
    out = rewards.detach().clone()
    if s.overlong_buffer_len is not None:
        if response_lengths is None:
            raise ValueError("shaping.overlong_buffer_len is set: pass response_lengths")
        assert s.max_response_len is not None  # AlgoConfig guarantees it
        penalty = shaping.overlong_penalty(
            response_lengths, s.max_response_len, s.overlong_buffer_len, s.overlong_penalty_factor
        )
        out = out + penalty.to(out.dtype)
    if s.stop_properly_penalty_coef is not None:
        if truncated is None:
            raise ValueError("shaping.stop_properly_penalty_coef is set: pass truncated")
        out = shaping.stop_properly_penalty(out, truncated, s.stop_properly_penalty_coef)
    if s.reward_clip is not None:
        out = shaping.clip_rewards(out, *s.reward_clip)
    return out


@torch.no_grad()
def compute_advantages(
    cfg: AlgoConfig,
    *,
    rewards: Tensor,
    group_index: Tensor,
    mask: Tensor,
    kl: Tensor | None = None,
    values: Tensor | None = None,
    kl_coef: float | None = None,
    turn_rewards: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Advantages [B,T] (and critic returns [B,T] for gae, else None) over the WHOLE learner batch.

    Args:
        rewards: [B] scalar (already shaped) reward per sequence: the whole return of a multi-turn episode.
        group_index: [B] integer group ids; samples answering the same prompt share an id. Group
            estimators (reinforce_baseline, rloo, grpo, dr_grpo) raise ``ValueError`` on a group of 1.
        mask: [B,T] loss mask (1 on generated response tokens; 0 on padding and tool tokens).
        kl: [B,T] per-token KL estimate ``k(logp_old, logp_ref)`` (``kl.kl_estimate`` with
            ``cfg.kl.estimator``); required when ``cfg.kl.placement == "reward"``, ignored otherwise.
        values: [B,T] critic values ``V(s_t)`` of the rollout; required by gae, ignored otherwise.
        kl_coef: the current KL coefficient (``KLController.value``); None uses ``cfg.kl.coef``.
        turn_rewards: [B,T] rewards of the turns before the last, on their last model tokens
            (``RLBatch.turn_rewards``). gae and reinforce credit them there and the rest of ``rewards``
            on the last valid token (``advantages.token_rewards``); the outcome estimators
            (reinforce_baseline, rloo, grpo, dr_grpo, flash_reinforce) use the scalar ``rewards``
            alone and ignore them. None = all of ``rewards`` on the last valid token.

    Returns:
        ``(advantages, returns)``: both 0 wherever ``mask`` is 0; detached. Call this BEFORE splitting
        the batch into micro-batches or data-parallel shards: group baselines, the batch mean of
        flash_reinforce and the global whitening all need every sample.
    """
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"expected rewards [B] and mask [B, T], got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    a = cfg.advantage
    kl_penalty = _reward_kl_penalty(cfg, kl, kl_coef)
    if a.estimator == "gae":
        if values is None:
            raise ValueError("advantage.estimator=gae: pass the critic values [B, T]")
        token_rewards = adv_fns.token_rewards(rewards, mask, turn_rewards)
        if kl_penalty is not None:
            token_rewards = token_rewards - torch.where(mask.bool(), kl_penalty, 0.0)
        advantages, returns = adv_fns.gae(token_rewards, values, mask, a.gamma, a.lam)
        return adv_fns.masked_whiten(advantages, mask, scale=a.std_normalize), returns
    if a.estimator == "reinforce":
        advantages = adv_fns.reinforce_plus_plus(
            rewards, mask, kl_penalty, gamma=a.gamma, scale=a.std_normalize, turn_rewards=turn_rewards
        )
        return advantages, None
    if a.estimator == "reinforce_baseline":
        return adv_fns.reinforce_baseline(rewards, group_index, mask, kl_penalty, scale=a.std_normalize), None
    scores = _outcome_scores(a, rewards, group_index, mask)
    return adv_fns.shaped_returns(scores, mask, kl_penalty), None


def _reward_kl_penalty(cfg: AlgoConfig, kl: Tensor | None, kl_coef: float | None) -> Tensor | None:
    """The per-token KL penalty [B,T] taken from the reward (``kl.placement = reward``), else None."""
    if cfg.kl.placement != "reward":
        return None
    if kl is None:
        raise ValueError("kl.placement=reward: pass the per-token kl [B, T]")
    return (cfg.kl.coef if kl_coef is None else kl_coef) * kl


def _outcome_scores(a: AdvantageConfig, rewards: Tensor, group_index: Tensor, mask: Tensor) -> Tensor:
    """The per-sequence scores [B] of the outcome estimators (rloo, grpo, dr_grpo, flash_reinforce)."""
    if a.estimator == "rloo":
        return adv_fns.rloo_scores(rewards, group_index)
    if a.estimator == "grpo":
        return adv_fns.grpo_scores(rewards, group_index, a.grpo_eps)
    if a.estimator == "dr_grpo":
        return adv_fns.dr_grpo_scores(rewards, group_index)
    if a.estimator == "flash_reinforce":
        if bool((mask.bool().sum(dim=1) == 0).any()):
            raise ValueError("flash_reinforce: a sequence has no valid response token (empty trajectory)")
        return adv_fns.flash_reinforce_scores(rewards)
    raise ValueError(f"unknown advantage estimator {a.estimator!r}")


def _correct(
    c: CorrectionConfig, old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor
) -> corr_fns.Correction:
    if c.type == "tis":
        return corr_fns.tis(old_logprobs, behaviour_logprobs, mask, c.low, c.high)
    if c.type == "icepop":
        return corr_fns.icepop(old_logprobs, behaviour_logprobs, mask, c.low, c.high)
    if c.type == "seq_mask_tis":
        return corr_fns.seq_mask_tis(old_logprobs, behaviour_logprobs, mask, c.low, c.high)
    if c.type == "decoupled":
        return corr_fns.decoupled(old_logprobs, behaviour_logprobs, mask, c.low, c.high)
    if c.type == "trust_gate":
        return corr_fns.trust_gate(old_logprobs, behaviour_logprobs, mask, c.gate_delta, c.gate_metric)
    raise ValueError(f"unknown correction type {c.type!r}")


def sample_correction(
    c: CorrectionConfig, *, old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Per sample ([B] each): the mean correction weight and the fraction of tokens masked, over its valid
    tokens. These are ``policy_objective``'s ``learner/correction/weight_mean`` and ``masked_frac`` taken
    per row instead of over the micro-batch (their token-weighted mean over the rows is those figures)."""
    valid = mask.bool()
    corrected = _correct(c, old_logprobs.detach(), behaviour_logprobs.detach(), mask)
    count = valid.sum(dim=1).clamp(min=1)
    weight = torch.where(valid, corrected.weights.detach().float(), 0.0).sum(dim=1) / count
    masked = (~corrected.kept & valid).sum(dim=1) / count
    return weight, masked


def _masked_mean(x: Tensor, valid: Tensor) -> float:
    return float(torch.where(valid, x.detach().float(), 0.0).sum() / valid.sum().clamp(min=1))


def policy_objective(
    cfg: AlgoConfig,
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    normaliser: float,
    behaviour_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    values: Tensor | None = None,
    old_values: Tensor | None = None,
    returns: Tensor | None = None,
    kl_coef: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Scalar differentiable loss of one micro-batch, and its metrics.

    Args (all [B,T] for this micro-batch, fp32 recommended):
        logprobs: log pi_theta of the sampled tokens, with grad.
        old_logprobs: log pi_old (proximal policy), recomputed by the trainer before the update.
        advantages: from ``compute_advantages`` (sliced to this micro-batch).
        mask: loss mask.
        normaliser: GLOBAL count for ``cfg.loss.aggregation`` summed over every micro-batch of the
            step and every rank (``losses.normaliser_count``); divide by the world size when the
            backend averages gradients.
        behaviour_logprobs: log mu from the inference engine; required when a correction is set,
            and used for the mismatch metrics whenever given.
        ref_logprobs: log pi_ref; required when ``cfg.kl.placement == "loss"``; logged when given.
        entropy: per-token entropy (``losses.entropy_from_logits``), with grad; required when
            ``cfg.loss.entropy_coef > 0``; logged when given.
        values, old_values, returns: current values (with grad), rollout values and GAE returns;
            required when ``cfg.critic`` is set.
        kl_coef: the current KL coefficient; None uses ``cfg.kl.coef``.

    Returns:
        ``(loss, metrics)``. Metrics ``learner/loss/{total,policy,kl,entropy,value}`` are this call's
        contributions to the step loss (sum them over micro-batches and ranks). The others are means
        over this call's valid tokens (weight them by ``learner/tokens`` to combine):
        ``learner/clip_frac``, ``learner/dual_clip_frac``, ``learner/ratio_mean``,
        ``learner/kl_ref``, ``learner/entropy``, ``learner/value/clip_frac``,
        ``learner/mismatch/kl`` (k1 of KL(mu || pi_old)), ``learner/mismatch/kl_k3``,
        ``learner/correction/masked_frac`` (share of valid tokens with weight zeroed),
        ``learner/correction/truncated_frac`` (share clamped by TIS), ``learner/correction/weight_mean``.
    """
    valid = mask.bool()
    lc = cfg.loss

    def agg(per_token: Tensor) -> Tensor:
        return aggregate(per_token, mask, lc.aggregation, normaliser, lc.norm_constant)

    old_logprobs = old_logprobs.detach()
    pl = _surrogate(lc, logprobs, old_logprobs, advantages.detach(), mask)
    per_token = pl.loss
    metrics: dict[str, float] = {
        "learner/tokens": float(valid.sum()),
        "learner/clip_frac": _masked_mean(pl.clipped, valid),
        "learner/dual_clip_frac": _masked_mean(pl.dual_clipped, valid),
        "learner/ratio_mean": _masked_mean(pl.ratio, valid),
    }

    per_token = _apply_correction(cfg.correction, per_token, old_logprobs, behaviour_logprobs, mask, metrics)
    if behaviour_logprobs is not None:
        k1, k3 = corr_fns.mismatch_kl(old_logprobs, behaviour_logprobs, mask)
        metrics["learner/mismatch/kl"] = float(k1)
        metrics["learner/mismatch/kl_k3"] = float(k3)

    policy = agg(per_token)
    total = policy
    metrics["learner/loss/policy"] = float(policy.detach())

    if ref_logprobs is not None:
        kl_tokens = kl_estimate(logprobs, ref_logprobs.detach(), cfg.kl.estimator)
        metrics["learner/kl_ref"] = _masked_mean(kl_tokens, valid)
    if cfg.kl.placement == "loss":
        if ref_logprobs is None:
            raise ValueError("kl.placement=loss: pass ref_logprobs")
        kl_term = (cfg.kl.coef if kl_coef is None else kl_coef) * agg(kl_tokens)
        total = total + kl_term
        metrics["learner/loss/kl"] = float(kl_term.detach())

    if entropy is not None:
        metrics["learner/entropy"] = _masked_mean(entropy, valid)
    if lc.entropy_coef > 0:
        if entropy is None:
            raise ValueError("loss.entropy_coef > 0: pass the per-token entropy")
        entropy_term = -lc.entropy_coef * agg(entropy)
        total = total + entropy_term
        metrics["learner/loss/entropy"] = float(entropy_term.detach())

    if cfg.critic is not None:
        if values is None or old_values is None or returns is None:
            raise ValueError("a critic is configured: pass values, old_values and returns")
        per_token_value, value_clipped = value_loss(
            values, old_values.detach(), returns.detach(), cfg.critic.value_clip
        )
        value_term = cfg.critic.value_coef * agg(per_token_value)
        total = total + value_term
        metrics["learner/loss/value"] = float(value_term.detach())
        metrics["learner/value/clip_frac"] = _masked_mean(value_clipped, valid)

    metrics["learner/loss/total"] = float(total.detach())
    return total, metrics


def _surrogate(lc: LossConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> PolicyLoss:
    """The configured clipped surrogate per token: ppo (token ratios) or gspo (sequence ratios)."""
    if lc.policy_loss == "ppo":
        return ppo_clip_loss(
            logprobs,
            old_logprobs,
            advantages,
            eps_low=lc.clip_eps_low,
            eps_high=lc.clip_eps_high,
            dual_clip=lc.dual_clip,
        )
    return gspo_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        eps_low=lc.clip_eps_low,
        eps_high=lc.clip_eps_high,
        dual_clip=lc.dual_clip,
    )


def _apply_correction(
    c: CorrectionConfig,
    per_token: Tensor,
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor | None,
    mask: Tensor,
    metrics: dict[str, float],
) -> Tensor:
    """``per_token`` weighted by the off-policy correction (unchanged when ``c.type`` is none); its
    ``learner/correction/*`` metrics are added to ``metrics``."""
    if c.type == "none":
        return per_token
    if behaviour_logprobs is None:
        raise ValueError(f"correction.type={c.type}: pass behaviour_logprobs")
    valid = mask.bool()
    corrected = _correct(c, old_logprobs, behaviour_logprobs.detach(), mask)
    metrics["learner/correction/masked_frac"] = _masked_mean(~corrected.kept, valid)
    metrics["learner/correction/truncated_frac"] = _masked_mean(corrected.truncated, valid)
    metrics["learner/correction/weight_mean"] = _masked_mean(corrected.weights, valid)
    return torch.where(corrected.kept, corrected.weights * per_token, 0.0)
