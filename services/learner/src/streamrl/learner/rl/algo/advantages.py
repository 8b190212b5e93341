"""Advantage estimators: scalar outcome rewards (+ optional per-token KL penalty) -> per-token advantages.

Notation (algorithms.md section 0): ``B`` sequences, ``T`` padded response width, ``m[i,t]`` the
loss mask (1 on tokens the policy generated; 0 on padding and on tool/observation tokens),
``T_i = sum_t m[i,t]``, ``R_i`` the scalar reward, ``g(i)`` the group (prompt) of sequence ``i``.

Front end (section 1.0): the scalar reward is put on the last valid token and the KL penalty
``kl_penalty[i,t] = beta * kl[i,t]`` (already multiplied by its coefficient) is subtracted per token::

    rew[i,t] = s_i * 1[t = T_i] - kl_penalty[i,t]

where ``s_i`` is the reward, or the group-baselined score for the group estimators. Then:

* ``gae`` (1.1):  ``delta_t = rew_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``,
  returns ``G_t = A_t + V_t``; advantages whitened over the batch.
* ``reinforce_plus_plus`` (1.2, 1.3): return-to-go ``G_t = sum_{k>=t} gamma^(k-t) rew_k``, whitened.
* ``reinforce_baseline`` (1.4): ``s_i = R_i - mean_g(R)``, return-to-go with gamma 1, whitened.
* ``rloo`` (1.7): ``s_i = R_i - mean_{j in g(i), j != i} R_j``; no whitening.
* ``grpo`` (1.5): ``s_i = (R_i - mean_g(R)) / (std_u_g(R) + eps)``; no whitening.
* ``dr_grpo`` (1.6): ``s_i = R_i - mean_g(R)``; no std, no whitening (its length normaliser is the
  loss aggregation ``seq-mean-token-sum-norm``, see ``losses.aggregate``).
* ``flash_reinforce`` (1.8a): ``s_i = R_i - mean_batch(R)``; no group, no std, no whitening.

Deliberate choices and simplifications:

* Group estimators subtract their baseline from the **scalar** reward and add the KL shaping per
  token afterwards (OpenRLHF's order), so with ``kl_penalty=None`` the advantage is ``s_i`` on every
  valid token; with KL in the reward ``A[i,t] = s_i - sum_{k>=t} kl_penalty[i,k]``.
* Tokens with ``m = 0`` inside a response (tool output) are skipped by every recursion: the running
  return / next value / running GAE are carried across them unchanged (verl 2026-08), so padding
  needs no special values. Outputs are 0 wherever ``m = 0``. Discounting therefore counts model
  tokens only: a multi-turn trajectory gets exactly the advantages of its model tokens laid end to
  end without the environment's (tests check this).
* Multi-turn rewards (docs/multiturn.md): the token-level estimators (gae, reinforce) take
  ``turn_rewards`` [B,T], the rewards of the turns before the last on their last model tokens, and
  put the rest of the return, ``R_i - sum_t turn_rewards[i,t]``, on the last valid token
  (``token_rewards``); the others use the scalar return ``R_i`` alone. Without turn rewards this is
  the front end above, bit for bit.
* Whitening is token weighted over the whole batch with the **biased** variance and a variance floor
  of 1e-8 (OpenRLHF): ``(A - mu) / sqrt(max(var, 1e-8))``. It needs at least 2 valid tokens. It runs
  after group centering, so an all-equal group of the REINFORCE++-baseline family can end with a
  non-zero advantage when lengths differ (section 1.4 subtlety); dynamic filtering removes those.
* Group baselines need every group to hold >= 2 samples; a smaller group raises ``ValueError``
  (no silent "mean := 0" fallback). Groups may have different sizes.
* All statistics must be taken over the WHOLE learner batch, before any micro-batch or
  data-parallel split; these functions do no communication.
"""

from __future__ import annotations

import torch
from torch import Tensor

WHITEN_VAR_FLOOR = 1e-8
"""Variance floor of the global whitening (OpenRLHF ``max(var, 1e-8)``)."""


def _check_batch(rewards: Tensor, mask: Tensor) -> None:
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"expected rewards [B] and mask [B, T], got {tuple(rewards.shape)} and {tuple(mask.shape)}")


def terminal_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Put ``scores[i]`` on the last valid token of row ``i`` (0 elsewhere, and 0 for an empty row). [B,T]."""
    _check_batch(scores, mask)
    valid = mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(valid)
    last = torch.where(valid, positions, -1).max(dim=1).values  # -1 for an empty row
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    has_token = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_token]
    out[rows, last[has_token]] = scores[has_token]
    return out


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go ``G_t = rew_t + gamma G_{t+1}`` over valid tokens; ``m = 0`` tokens carry G through. [B,T]."""
    valid = mask.bool()
    if gamma == 1.0:  # fast path: reverse cumulative sum of the valid rewards
        masked = torch.where(valid, token_rewards, 0.0)
        running = masked.flip(1).cumsum(1).flip(1)
        return torch.where(valid, running, 0.0)
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(valid[:, t], token_rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(valid[:, t], running, 0.0)
    return out


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (section 1.1). Returns ``(advantages, returns)``, both [B,T], 0 off-mask.

    ``V`` after the last valid token is 0; ``m = 0`` tokens are skipped (next value and running GAE
    are carried across them). ``returns = advantages + values`` is the critic's regression target.
    """
    if values.shape != token_rewards.shape:
        raise ValueError(f"values {tuple(values.shape)} must match rewards {tuple(token_rewards.shape)}")
    valid = mask.bool()
    values = values.detach()
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = torch.where(valid[:, t], step, running)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(valid[:, t], step, 0.0)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns


def masked_whiten(x: Tensor, mask: Tensor, *, scale: bool = True, var_floor: float = WHITEN_VAR_FLOOR) -> Tensor:
    """Token-weighted global whitening ``(x - mu) / sqrt(max(var_b, floor))`` over valid tokens; 0 off-mask.

    ``scale=False`` only centres (OpenRLHF ``no_std_norm``). Raises ``ValueError`` with fewer than 2 valid tokens.
    """
    valid = mask.bool()
    count = int(valid.sum())
    if count < 2:
        raise ValueError(f"whitening needs at least 2 valid tokens in the batch, got {count}")
    mean = torch.where(valid, x, 0.0).sum() / count
    centred = torch.where(valid, x - mean, 0.0)
    if not scale:
        return centred
    var = (centred**2).sum() / count
    return centred / torch.sqrt(torch.clamp(var, min=var_floor))


def group_statistics(rewards: Tensor, group_index: Tensor, *, min_group_size: int = 2) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample ``(group mean, unbiased group std, group size)`` of ``rewards``, each [B].

    ``group_index`` holds integer group ids (samples of one group share an id; any order, any ids).
    Raises ``ValueError`` if a group has fewer than ``min_group_size`` samples.
    """
    if group_index.shape != rewards.shape or rewards.dim() != 1:
        raise ValueError(f"group_index {tuple(group_index.shape)} must match rewards {tuple(rewards.shape)} (both [B])")
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool:
        raise ValueError(f"group_index must hold integer group ids, got dtype {group_index.dtype}")
    _, inverse = torch.unique(group_index, return_inverse=True)
    sizes = torch.bincount(inverse)
    if int(sizes.min()) < min_group_size:
        raise ValueError(
            f"a group baseline needs groups of at least {min_group_size} samples, but a group has "
            f"{int(sizes.min())} (sample more than one response per prompt, or pick a group-free estimator)"
        )
    n = sizes.to(rewards.dtype)
    mean = torch.zeros_like(n).index_add_(0, inverse, rewards) / n
    squares = torch.zeros_like(n).index_add_(0, inverse, (rewards - mean[inverse]) ** 2)
    std = torch.sqrt(squares / (n - 1).clamp(min=1))
    return mean[inverse], std[inverse], n[inverse]


def token_rewards(returns: Tensor, mask: Tensor, turn_rewards: Tensor | None = None) -> Tensor:
    """Per-token rewards [B,T] that sum to ``returns`` [B] over each row's valid tokens.

    Without ``turn_rewards`` the whole return sits on the last valid token (:func:`terminal_rewards`).
    With them ([B,T], the earlier turns' rewards on model tokens), each stays where it is and the last
    valid token gets the rest, ``returns - sum_t turn_rewards``: the final turn's reward, and whatever
    shaping did to the scalar. Rewards on ``m = 0`` positions are dropped (none are placed there).
    """
    if turn_rewards is None:
        return terminal_rewards(returns, mask)
    if turn_rewards.shape != mask.shape:
        raise ValueError(f"turn_rewards {tuple(turn_rewards.shape)} must match the mask {tuple(mask.shape)}")
    earlier = torch.where(mask.bool(), turn_rewards.to(returns.dtype), 0.0)
    return terminal_rewards(returns - earlier.sum(dim=1), mask) + earlier


def shaped_returns(
    scores: Tensor, mask: Tensor, kl_penalty: Tensor | None, gamma: float = 1.0, turn_rewards: Tensor | None = None
) -> Tensor:
    """Return-to-go of ``scores`` (on the last valid token, earlier ``turn_rewards`` where they lie) minus
    the per-token ``kl_penalty``. [B,T]."""
    rew = token_rewards(scores, mask, turn_rewards)
    if kl_penalty is not None:
        rew = rew - torch.where(mask.bool(), kl_penalty, 0.0)
    return discounted_returns(rew, mask, gamma)


def reinforce_plus_plus(
    rewards: Tensor,
    mask: Tensor,
    kl_penalty: Tensor | None,
    *,
    gamma: float = 1.0,
    scale: bool = True,
    turn_rewards: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ (1.3): KL-shaped return-to-go (per-turn rewards where they lie), whitened over all
    valid tokens of the batch. [B,T]."""
    return masked_whiten(shaped_returns(rewards, mask, kl_penalty, gamma, turn_rewards), mask, scale=scale)


def reinforce_baseline(
    rewards: Tensor, group_index: Tensor, mask: Tensor, kl_penalty: Tensor | None, *, scale: bool = True
) -> Tensor:
    """REINFORCE++-baseline (1.4): group-mean baseline on the scalar, KL-shaped return-to-go, whitened. [B,T]."""
    mean, _, _ = group_statistics(rewards, group_index)
    return masked_whiten(shaped_returns(rewards - mean, mask, kl_penalty), mask, scale=scale)


def rloo_scores(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO (1.7): ``R_i - mean of the other samples of its group`` = ``G/(G-1) (R_i - mean_g)``. [B]."""
    mean, _, n = group_statistics(rewards, group_index)
    return n / (n - 1) * (rewards - mean)


def grpo_scores(rewards: Tensor, group_index: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO (1.5): ``(R_i - mean_g) / (std_u_g + eps)``; an all-equal group gives 0. [B]."""
    mean, std, _ = group_statistics(rewards, group_index)
    return (rewards - mean) / (std + eps)


def dr_grpo_scores(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Dr. GRPO (1.6): ``R_i - mean_g`` (no std division). [B]."""
    mean, _, _ = group_statistics(rewards, group_index)
    return rewards - mean


def flash_reinforce_scores(rewards: Tensor) -> Tensor:
    """FlashREINFORCE (1.8a): ``R_i - mean over the whole batch`` (one rollout per prompt, no group). [B]."""
    if rewards.numel() == 0:
        raise ValueError("flash_reinforce needs a non-empty batch")
    return rewards - rewards.mean()
