"""Pure losses of the offline stages (algorithms.md sections 3.7, 3.9, 3.10).

SFT (token mean over response tokens, prompt and padding masked)::

    L = sum_t m_t * (-log pi(y_t)) / sum_t m_t

Pairwise reward model (Bradley-Terry; Llama-2 margin when a per-pair margin is given)::

    L = -log sigmoid(r_w - r_l - margin)

Preference optimisation, with ``s(y)`` the *summed* response log-prob and
``z = [s_theta(y_w) - s_theta(y_l)] - [s_ref(y_w) - s_ref(y_l)]``::

    DPO   L = -log sigmoid(beta z)
    cDPO  L = -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)    (label smoothing eps > 0)
    IPO   L = (z - 1 / (2 beta))^2                                          (beta plays tau)

Implicit rewards are ``beta (s_theta(y) - s_ref(y))``. Summed (not length-normalised) log-probs
are used for IPO as well; a chosen == rejected pair gives z = 0 and a DPO loss of log 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import logsigmoid

from streamrl.learner.offline.config import PreferenceLoss


def masked_nll(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood over positions where ``mask`` is set (0 if none)."""
    mask = mask.to(logprobs.dtype)
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1.0)


def sequence_logprob(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed log-prob of each sequence over its masked positions: ``(B, T) -> (B,)``."""
    return (logprobs * mask.to(logprobs.dtype)).sum(-1)


def bradley_terry_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean of ``-log sigmoid(r_w - r_l - margin)`` over pairs."""
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    return -logsigmoid(diff).mean()


@dataclass(frozen=True, slots=True)
class PreferenceOutput:
    """Per-pair loss terms and implicit rewards of a preference-optimisation batch."""

    loss: torch.Tensor
    """Mean loss over the pairs (scalar)."""
    chosen_rewards: torch.Tensor
    """beta * (s_theta(y_w) - s_ref(y_w)), detached, shape (B,)."""
    rejected_rewards: torch.Tensor
    """beta * (s_theta(y_l) - s_ref(y_l)), detached, shape (B,)."""


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: PreferenceLoss = "sigmoid",
    label_smoothing: float = 0.0,
) -> PreferenceOutput:
    """DPO (``sigmoid``), cDPO (``sigmoid`` with ``label_smoothing`` > 0) or IPO on summed sequence log-probs."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")
    z = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * logsigmoid(beta * z) - label_smoothing * logsigmoid(-beta * z)
    elif loss_type == "ipo":
        if label_smoothing:
            raise ValueError("label_smoothing applies to the sigmoid (DPO) loss only, not to IPO")
        losses = (z - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {loss_type!r}; expected 'sigmoid' or 'ipo'")
    return PreferenceOutput(
        loss=losses.mean(),
        chosen_rewards=(beta * (policy_chosen - ref_chosen)).detach(),
        rejected_rewards=(beta * (policy_rejected - ref_rejected)).detach(),
    )
