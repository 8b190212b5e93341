"""Pure: combine several scorers' per-sample outputs into one reward, score and metrics dict.

For sample i with scorers k of weight w_k (w_k >= 0, at least one > 0):

    reward_i = sum_k w_k * reward_ki
    score_i  = sum_k w_k * score_ki / sum_k w_k        (a weighted mean: stays in [0, 1])

Every scorer's own values are kept as extra metrics, ``{name}/reward``, ``{name}/score`` and
``{name}/{metric}`` for its extra metrics, so a weight-0 scorer is logged without being trained on.
A sample's ``attempts`` is the most backend calls any scorer needed for it.

A sample for which any scorer's values are unusable (:meth:`ScorerResult.problem`: not a number,
NaN, infinite) is *invalid*: its ``invalid`` says why, per scorer, and its reward and score are
``invalid_value`` (NaN when None: the reward service then fails that sample alone), its extra
metrics only the finite ones. Its neighbours in the batch are combined as usual.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from streamrl.reward.scorers.base import ScorerResult


@dataclass(frozen=True)
class WeightedResult:
    """One scorer's result on a batch, with the scorer's name and weight."""

    name: str
    weight: float
    result: ScorerResult


@dataclass(frozen=True)
class CombinedScore:
    """The combined values of one sample."""

    reward: float
    score: float
    extra: dict[str, float]
    attempts: int = 1
    """Backend calls the sample needed, the most over the scorers (1 = no retry)."""
    invalid: str = ""
    """Why a scorer's values for this sample are unusable ("" = they are all usable)."""


def combine(parts: Sequence[WeightedResult], invalid_value: float | None = None) -> list[CombinedScore]:
    """Combine the results of every scorer on the same batch (same sample order); an invalid sample's
    reward and score are ``invalid_value`` (NaN when None)."""
    if not parts:
        raise ValueError("combine needs at least one scorer result")
    total_weight = sum(p.weight for p in parts)
    if total_weight <= 0:
        raise ValueError(f"scorer weights must sum to > 0, got {[p.weight for p in parts]}")
    n = len(parts[0].result.rewards)
    for p in parts:
        r = p.result
        if not len(r.rewards) == len(r.scores) == len(r.extra) == n:
            raise ValueError(
                f"scorer {p.name!r} returned {len(r.rewards)} rewards, {len(r.scores)} scores and "
                f"{len(r.extra)} extra dicts for a batch of {n}"
            )
    combined = []
    for i in range(n):
        extra: dict[str, float] = {}
        for p in parts:
            extra[f"{p.name}/reward"] = p.result.rewards[i]
            extra[f"{p.name}/score"] = p.result.scores[i]
            for key, value in p.result.extra[i].items():
                extra[f"{p.name}/{key}"] = value
        attempts = max(p.result.attempts_of(i) for p in parts)
        problems = [f"scorer {p.name!r}: {why}" for p in parts if (why := p.result.problem(i))]
        if problems:
            value = math.nan if invalid_value is None else invalid_value
            finite = {k: v for k, v in extra.items() if math.isfinite(v)}
            combined.append(CombinedScore(value, value, finite, attempts, invalid="; ".join(problems)))
            continue
        combined.append(
            CombinedScore(
                reward=sum(p.weight * p.result.rewards[i] for p in parts),
                score=sum(p.weight * p.result.scores[i] for p in parts) / total_weight,
                extra=extra,
                attempts=attempts,
            )
        )
    return combined
