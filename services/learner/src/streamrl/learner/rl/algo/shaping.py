"""Scalar reward shaping applied before any baseline or normalisation (algorithms.md 1.0, 5.2, 5.3).

* Overlong penalty (DAPO soft punishment, 5.2), with ``L_max`` the maximum response length and
  ``L_cache`` the buffer::

      R_length(y) = 0                                   |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                  = -1                                  |y| > L_max
      R <- R + factor * R_length

* Stop-properly penalty (ProRL, 5.3) on truncated responses (``finish_reason = length``):
  ``c >= 0: R <- c * R``; ``c < 0: R <- c``.
* Reward clipping (OpenRLHF ``clip_range``): ``R <- clamp(R, lo, hi)``.

``objective.shape_rewards`` applies them in that order: overlong, stop-properly, clip, so the clip
bounds the final reward.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(response_lengths: Tensor, max_length: int, buffer_length: int, factor: float = 1.0) -> Tensor:
    """DAPO's length penalty ``factor * R_length`` (<= 0) per sequence from response lengths in tokens; float64 [B]."""
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"overlong buffer must satisfy 0 < buffer <= max_length, got {buffer_length} and {max_length}")
    expected = max_length - buffer_length
    excess = torch.clamp(response_lengths.to(torch.float64) - expected, min=0.0, max=float(buffer_length))
    return -factor * excess / buffer_length


def stop_properly_penalty(rewards: Tensor, truncated: Tensor, coef: float) -> Tensor:
    """Penalise truncated responses: ``coef * R`` if ``coef >= 0`` else the constant ``coef``. [B]."""
    penalised = rewards * coef if coef >= 0 else torch.full_like(rewards, coef)
    return torch.where(truncated.bool(), penalised, rewards)


def clip_rewards(rewards: Tensor, low: float, high: float) -> Tensor:
    """``clamp(R, low, high)``. [B]."""
    if low > high:
        raise ValueError(f"reward clip range must have low <= high, got ({low}, {high})")
    return torch.clamp(rewards, low, high)
