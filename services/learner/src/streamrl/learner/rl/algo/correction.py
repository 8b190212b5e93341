"""Off-policy correction between the inference engine (behaviour, mu) and the trainer (proximal, pi_old).

Every correction turns the mismatch ratio ``rho_t = pi_old(y_t) / mu(y_t)`` into a detached per-token
weight ``w_t`` that multiplies the clipped PPO loss (decoupled form, algorithms.md 4.0 and 4.5)::

    l_t = - sg(w_t) * min(r_t A_t, clip(r_t) A_t),     r_t = pi_theta / pi_old

    tis           w_t = clamp(rho_t, lo, hi)                 (4.1; two-sided as OpenRLHF, lo None = min(rho, hi))
    icepop        w_t = rho_t * 1[lo <= rho_t <= hi]         (4.2; both bounds inclusive)
    seq_mask_tis  w_t = rho_t * 1[lo <= rho_geo_i <= hi]     (4.3; rho_geo_i = exp(mean_t log rho_t);
                                                               token weights NOT truncated, OpenRLHF HEAD)
    decoupled     w_t = rho_t * 1[rho_t <= hi] (and >= lo if set)   (4.4; AReaL pi_prox / pi_behav with
                                                               its old "token_mask at 5.0" default)
    trust_gate    w_t = rho_t * 1[Dbar_i <= delta]           (1.8c; FlashREINFORCE sequence gate on the
                                                               mean binary KL (or TV) of the sampled token)

Binary KL of the sampled token, with ``p = mu(y_t)``, ``q = pi(y_t)`` both clamped to
[1e-6, 1 - 1e-6]: ``d_t = p log(p/q) + (1-p) log((1-p)/(1-q))``; TV: ``d_t = |p - q|``;
``Dbar_i = (1/T_i) sum_t m d_t``.

Conventions: log-ratios are clamped to [-20, 20] before ``exp``; rejected tokens get weight 0 via
``torch.where`` (never ``rho * 0``, which is NaN for an overflowed ratio); rejected tokens stay in the
loss denominator (OpenRLHF, AReaL, NeMo-RL). Each function returns a ``Correction`` whose ``kept`` /
``truncated`` masks feed the metrics ``masked_frac`` / ``truncated_frac``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

GateMetric = Literal["binary_kl", "tv"]

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-20, 20] before ``exp``."""
PROB_CLAMP = 1e-6
"""Probabilities in the trust gate are clamped to [PROB_CLAMP, 1 - PROB_CLAMP]."""


class Correction(NamedTuple):
    """Detached importance weights and what they did, all [B,T]; off-mask positions are 0 / False."""

    weights: Tensor
    kept: Tensor
    """Bool: valid token whose weight was not zeroed by a mask/gate."""
    truncated: Tensor
    """Bool: valid token whose ratio was clamped (TIS only)."""


def mismatch_log_ratio(old_logprobs: Tensor, behaviour_logprobs: Tensor) -> Tensor:
    """``log rho = clamp(log pi_old - log mu, -20, 20)``, detached. [B,T]."""
    return torch.clamp(old_logprobs - behaviour_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).detach()


def _result(weights: Tensor, kept: Tensor, valid: Tensor, truncated: Tensor | None = None) -> Correction:
    kept = kept & valid
    weights = torch.where(kept, weights, 0.0)
    if truncated is None:
        truncated = torch.zeros_like(valid)
    return Correction(weights, kept, truncated & valid)


def tis(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, low: float | None, high: float) -> Correction:
    """Truncated importance sampling: ``clamp(rho, low, high)`` (``low=None``: ``min(rho, high)``)."""
    valid = mask.bool()
    rho = torch.exp(mismatch_log_ratio(old_logprobs, behaviour_logprobs))
    weights = torch.clamp(rho, min=low, max=high)
    truncated = rho > high
    if low is not None:
        truncated = truncated | (rho < low)
    return _result(weights, valid, valid, truncated)


def _inside(rho: Tensor, low: float | None, high: float) -> Tensor:
    inside = rho <= high
    if low is not None:
        inside = inside & (rho >= low)
    return inside


def icepop(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, low: float | None, high: float
) -> Correction:
    """IcePop: keep ``rho`` where ``low <= rho <= high`` (inclusive), weight 0 elsewhere."""
    rho = torch.exp(mismatch_log_ratio(old_logprobs, behaviour_logprobs))
    return _result(rho, _inside(rho, low, high), mask.bool())


def decoupled(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, low: float | None, high: float
) -> Correction:
    """AReaL decoupled PPO weight ``pi_prox / pi_behav``, tokens above ``high`` (below ``low`` if set) masked.

    Same arithmetic as ``icepop``; kept separate because its reference default has no lower bound.
    """
    return icepop(old_logprobs, behaviour_logprobs, mask, low, high)


def _sequence_mean(x: Tensor, valid: Tensor) -> Tensor:
    lengths = valid.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.where(valid, x, 0.0).sum(dim=1, keepdim=True) / lengths


def seq_mask_tis(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, low: float | None, high: float
) -> Correction:
    """Seq-Mask-TIS: drop whole sequences whose geometric-mean ratio leaves [low, high]; token weights ``rho``."""
    valid = mask.bool()
    log_rho = mismatch_log_ratio(old_logprobs, behaviour_logprobs)
    rho_geo = torch.exp(_sequence_mean(log_rho, valid))  # [B,1]
    keep_sequence = _inside(rho_geo, low, high).expand_as(valid)
    return _result(torch.exp(log_rho), keep_sequence, valid)


def token_divergence(logprobs: Tensor, behaviour_logprobs: Tensor, metric: GateMetric) -> Tensor:
    """Per-token binary KL (or TV) between ``mu(y_t)`` and ``pi(y_t)`` of the sampled token, detached. [B,T]."""
    p = torch.exp(behaviour_logprobs.detach()).clamp(PROB_CLAMP, 1.0 - PROB_CLAMP)
    q = torch.exp(logprobs.detach()).clamp(PROB_CLAMP, 1.0 - PROB_CLAMP)
    if metric == "tv":
        return (p - q).abs()
    if metric == "binary_kl":
        return p * torch.log(p / q) + (1.0 - p) * torch.log((1.0 - p) / (1.0 - q))
    raise ValueError(f"unknown trust-gate metric {metric!r}; expected binary_kl or tv")


def trust_gate(
    logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, delta: float, metric: GateMetric = "binary_kl"
) -> Correction:
    """FlashREINFORCE gate: weight ``rho = pi/mu`` (not clipped) on sequences with ``Dbar_i <= delta``, else 0.

    Raises ``FloatingPointError`` if an admitted token's weight is not finite (the reference has no clip).
    """
    valid = mask.bool()
    mean_divergence = _sequence_mean(token_divergence(logprobs, behaviour_logprobs, metric), valid)
    keep_sequence = (mean_divergence <= delta).expand_as(valid)
    rho = torch.exp(mismatch_log_ratio(logprobs, behaviour_logprobs))
    out = _result(rho, keep_sequence, valid)
    if not bool(torch.isfinite(out.weights).all()):
        raise FloatingPointError("trust_gate: a non-finite importance weight on an admitted token (NaN log-probs?)")
    return out


def mismatch_kl(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Engine-vs-trainer KL(mu || pi_old) over valid tokens (sampled from mu): ``(k1 mean, k3 mean)``, scalars.

    k1 = ``mean(log mu - log pi_old)`` (OpenRLHF ``vllm_kl``); k3 = ``mean(rho - 1 - log rho)`` >= 0.
    """
    valid = mask.bool()
    count = valid.sum().clamp(min=1)
    log_rho = mismatch_log_ratio(old_logprobs, behaviour_logprobs)
    k1 = torch.where(valid, -log_rho, 0.0).sum() / count
    k3 = torch.where(valid, torch.exp(log_rho) - 1.0 - log_rho, 0.0).sum() / count
    return k1, k3
