"""KL regularisation: per-token estimators of KL(pi || pi_ref) and the fixed / adaptive coefficient.

Estimators (algorithms.md 2.1, Schulman "Approximating KL Divergence"), with
``Delta = logp(y) - logp_ref(y)`` for a token ``y`` sampled from ``pi``::

    k1  = Delta                            unbiased, can be negative; use it in the reward
    k2  = 0.5 * Delta^2                    >= 0; as a loss its gradient is the reverse-KL gradient
    k3  = exp(-Delta) - 1 + Delta          unbiased, >= 0 (verl ``low_var_kl``); as a loss its
                                           gradient is the FORWARD KL's (section 2.2, Tang & Munos)
    k3+ = value of k3, gradient of k2      (straight-through; verl ``k3+``)

Clamps: ``-Delta`` is clamped to [-20, 20] before ``exp`` (k3), and every estimate is clamped to
[-10, 10] (OpenRLHF). Where the KL goes (reward or loss) and its coefficient are chosen by the
caller (``objective``); "do not enable both places at once" is enforced by ``AlgoConfig``.

Adaptive coefficient (2.3, Ziegler et al. arXiv:1909.08593)::

    e    = clip(KL_cur / KL_target - 1, -0.2, 0.2)
    beta = beta * (1 + e * n_steps / horizon)

with ``KL_cur`` the batch mean of each sequence's token-mean KL and ``n_steps`` the number of
sequences in the batch (verl's choices). Only meaningful for KL in the reward.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3", "k3+"]

KL_CLAMP = 10.0
"""Every estimate is clamped to [-KL_CLAMP, KL_CLAMP]."""
LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before ``exp``."""


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token KL estimate of ``pi`` (``logprobs``) against ``pi_ref``; same shape as the inputs.

    Differentiable through ``logprobs`` (for KL in the loss); detach the inputs for KL in the reward.
    Padding positions hold whatever the inputs give: mask them downstream.
    """
    delta = logprobs - ref_logprobs
    if estimator == "k1":
        out = delta
    elif estimator == "k2":
        out = 0.5 * delta**2
    elif estimator in ("k3", "k3+"):
        neg = torch.clamp(-delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        out = torch.exp(neg) - 1.0 - neg
        if estimator == "k3+":
            k2 = 0.5 * delta**2
            out = k2 + (out - k2).detach()
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of k1, k2, k3, k3+")
    return torch.clamp(out, -KL_CLAMP, KL_CLAMP)


def sequence_mean_kl(kl: Tensor, mask: Tensor) -> Tensor:
    """``KL_cur`` of the adaptive controller: mean over non-empty sequences of each one's token-mean KL (scalar)."""
    valid = mask.bool()
    lengths = valid.sum(dim=1)
    per_seq = torch.where(valid, kl, 0.0).sum(dim=1) / lengths.clamp(min=1)
    nonempty = lengths > 0
    if not bool(nonempty.any()):
        raise ValueError("sequence_mean_kl needs at least one sequence with a valid token")
    return per_seq[nonempty].mean()


def adaptive_kl_coef(coef: float, current_kl: float, target: float, n_steps: int, horizon: int) -> float:
    """One step of the proportional controller: ``coef * (1 + clip(kl/target - 1, -0.2, 0.2) * n_steps / horizon)``."""
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got target={target}, horizon={horizon}")
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


class KLController:
    """The current KL coefficient: fixed (``target=None``) or adaptive. The learner checkpoints ``value``."""

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10_000) -> None:
        self.value = coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Fold in one batch's ``KL_cur`` over ``n_steps`` sequences; returns the new coefficient."""
        if self.target is not None:
            self.value = adaptive_kl_coef(self.value, current_kl, self.target, n_steps, self.horizon)
        return self.value
