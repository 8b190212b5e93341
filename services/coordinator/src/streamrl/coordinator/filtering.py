"""DAPO dynamic filtering: keep only groups whose scores differ (pure Python, no torch).

A group (the samples answering one prompt) whose scores are all equal gives every sample the same
group-relative advantage, 0 for GRPO / RLOO / Dr. GRPO: it carries no policy gradient and only
dilutes the batch (algorithms.md 5.1). DAPO keeps a group iff ``std_g(score) > 0``, i.e.
``0 < #correct < G`` for binary scores. Here "spread" is ``max - min > min_spread`` so that
non-binary rewards work too, and float noise can be ignored with a small ``min_spread``.
Optionally (OpenRLHF ``dynamic_filtering_range``) a group is kept only if ``low < mean < high``
(strict).

Deliberate choices:

* Groups of fewer than 2 samples raise ``ValueError`` (verl silently keeps them; a filter on
  spread is meaningless for them, so this is a configuration error).
* The function only classifies: it never drops an accepted group and keeps the input order.
  The caller accumulates kept groups across calls until a training batch is full. At the end of
  the dataset (or of an epoch) the caller must NOT discard the accepted groups still waiting for a
  full batch: it emits them as a final, smaller batch (or carries them into the next epoch).
  Filtered-out groups are counted, never silently lost: report ``FilterResult`` counts as metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

G = TypeVar("G")


@dataclass(frozen=True)
class FilterResult(Generic[G]):
    """Outcome of one filtering pass; ``kept`` and ``dropped`` keep the input order."""

    kept: list[G] = field(default_factory=list)
    """Groups with spread (and mean inside the range, if one is given)."""
    dropped: list[G] = field(default_factory=list)
    """Groups filtered out."""
    num_all_equal: int = 0
    """Dropped because every score in the group was equal (within ``min_spread``)."""
    num_out_of_range: int = 0
    """Dropped because the group's mean score was outside ``(low, high)``."""

    @property
    def num_kept(self) -> int:
        """Number of groups kept."""
        return len(self.kept)

    @property
    def num_dropped(self) -> int:
        """Number of groups dropped."""
        return len(self.dropped)


def has_spread(scores: Sequence[float], min_spread: float = 0.0) -> bool:
    """True iff ``max(scores) - min(scores) > min_spread``. Raises ``ValueError`` for fewer than 2 scores."""
    if len(scores) < 2:
        raise ValueError(f"dynamic filtering needs groups of at least 2 samples, got a group of {len(scores)}")
    return max(scores) - min(scores) > min_spread


def filter_groups(
    groups: Iterable[G],
    scores: Callable[[G], Sequence[float]],
    *,
    min_spread: float = 0.0,
    mean_range: tuple[float, float] | None = None,
) -> FilterResult[G]:
    """Split ``groups`` into kept and dropped by the spread of ``scores(group)``.

    Args:
        groups: any group objects (e.g. lists of ``ScoredTrajectory``).
        scores: returns the per-sample scores (or rewards) of a group.
        min_spread: a group is kept iff ``max - min > min_spread`` (0 = any difference).
        mean_range: optional ``(low, high)``: also require ``low < mean(scores) < high``.
    """
    if min_spread < 0:
        raise ValueError(f"min_spread must be >= 0, got {min_spread}")
    if mean_range is not None and mean_range[0] >= mean_range[1]:
        raise ValueError(f"mean_range needs low < high, got {mean_range}")
    kept: list[G] = []
    dropped: list[G] = []
    all_equal = out_of_range = 0
    for group in groups:
        values = scores(group)
        if not has_spread(values, min_spread):
            all_equal += 1
            dropped.append(group)
            continue
        if mean_range is not None:
            mean = sum(values) / len(values)
            if not mean_range[0] < mean < mean_range[1]:
                out_of_range += 1
                dropped.append(group)
                continue
        kept.append(group)
    return FilterResult(kept, dropped, all_equal, out_of_range)
