"""Policy and value losses per token, and their aggregation to a scalar.

PPO clipped surrogate (algorithms.md 3.1, 3.3), per token, with clip-higher bounds::

    r_t = exp(clamp(logp_theta - logp_old, -20, 20))
    l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

Dual clip (3.2, needs ``c > 1``): for ``A_t < 0`` the loss is capped at ``-c A_t``:
``l_t = min(l_t, -c A_t)``.

GSPO (1.9, arXiv:2507.18071): the ratio is the sequence's geometric mean
``s_i = exp((1/T_i) sum_t m (logp_theta - logp_old))``, used per token in the "GSPO-token" form
``s_i,t = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t))`` (value ``s_i``, gradient
``s_i grad logp_t``), then clipped as above. With ``seq-mean-token-mean`` aggregation and a
per-sequence advantage this is exactly the paper's sequence objective.

Clipped value loss (3.5)::

    V_clip = V_old + clip(V - V_old, -eps_v, eps_v)
    l_t    = 0.5 * max((V - G)^2, (V_clip - G)^2)          (eps_v None: 0.5 (V - G)^2)

Entropy (3.6) from logits: ``H_t = -sum_v p_v log p_v``; the objective subtracts ``c_H * agg(H)``.

Aggregation (3.4) of a per-token loss ``l`` with mask ``m``; ``N`` is the caller's GLOBAL normaliser
(over every micro-batch of the step and every data-parallel rank), so the sum of the aggregates of
the micro-batches equals the aggregate of the whole batch::

    token-mean               sum_{i,t} m l / N                    N = total valid tokens
    seq-mean-token-mean      sum_i (1/T_i) sum_t m l / N          N = total sequences with T_i > 0
    seq-mean-token-sum       sum_i sum_t m l / N                  N = total sequences with T_i > 0
    seq-mean-token-sum-norm  sum_i sum_t m l / (N * C)            N as above, C constant (max length)

``normaliser_count(mask, mode)`` gives this micro-batch's share of ``N``; the caller sums it over
micro-batches and all-reduces it over ranks. A data-parallel backend that AVERAGES gradients over
ranks (DeepSpeed, DDP) needs ``N / world_size`` instead (section 3.4, "DP invariance").

Simplifications: masked positions are excluded with ``torch.where`` (never ``* 0``: padded
log-probs may be inf/NaN); the clip fraction counts tokens where the clipped branch is the active
(strictly smaller-objective) one, i.e. tokens with zero policy gradient.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-20, 20] before ``exp``."""


class PolicyLoss(NamedTuple):
    """Per-token policy loss and its diagnostics, all [B,T] (mask not applied)."""

    loss: Tensor
    ratio: Tensor
    """The (detached) ratio used in the surrogate."""
    clipped: Tensor
    """Bool: the clipped branch is active (zero gradient)."""
    dual_clipped: Tensor
    """Bool: the dual-clip cap is active (``A < 0`` and ``-c A`` < the PPO loss)."""


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> PolicyLoss:
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -dual_clip * advantages
        dual_active = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)
    return PolicyLoss(loss, ratio.detach(), clip_active, dual_active)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyLoss:
    """Token-level PPO clipped surrogate with clip-higher and optional dual clip. Inputs [B,T]."""
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return _clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> PolicyLoss:
    """GSPO: PPO clipping on the sequence's geometric-mean ratio (GSPO-token form). Inputs [B,T]."""
    valid = mask.bool()
    lengths = valid.sum(dim=1, keepdim=True).clamp(min=1)
    seq_log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0).sum(dim=1, keepdim=True) / lengths
    seq_log_ratio = torch.clamp(seq_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    return _clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip_eps: float | None) -> tuple[Tensor, Tensor]:
    """Clipped value loss per token and a bool [B,T] of tokens where the clipped term is the larger one."""
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    values_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    clipped = (values_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Full-vocabulary entropy ``-sum_v p_v log p_v`` of ``logits`` [..., V] -> [...]."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def normaliser_count(mask: Tensor, mode: LossAggregation) -> int:
    """This micro-batch's share of the global normaliser: valid tokens (token-mean) or non-empty sequences."""
    valid = mask.bool()
    if mode == "token-mean":
        return int(valid.sum())
    return int((valid.sum(dim=1) > 0).sum())


def aggregate(
    per_token: Tensor, mask: Tensor, mode: LossAggregation, normaliser: float, constant: float | None = None
) -> Tensor:
    """Scalar aggregate of a per-token loss [B,T] under ``mode`` with the GLOBAL ``normaliser`` (see module doc).

    ``constant`` is ``C`` of ``seq-mean-token-sum-norm`` (required there, ignored elsewhere).
    """
    if normaliser <= 0:
        raise ValueError(f"the loss normaliser must be > 0, got {normaliser}")
    valid = mask.bool()
    masked = torch.where(valid, per_token, 0.0)
    if mode == "token-mean":
        return masked.sum() / normaliser
    per_sequence = masked.sum(dim=1)
    if mode == "seq-mean-token-mean":
        lengths = valid.sum(dim=1)
        return (per_sequence / lengths.clamp(min=1)).sum() / normaliser
    if mode == "seq-mean-token-sum":
        return per_sequence.sum() / normaliser
    if mode == "seq-mean-token-sum-norm":
        if constant is None or constant <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs a constant C > 0 (max response length), got {constant}")
        return per_sequence.sum() / (normaliser * constant)
    raise ValueError(f"unknown loss aggregation {mode!r}")
