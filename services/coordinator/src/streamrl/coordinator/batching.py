"""Which complete groups go into the next training batch (pure).

Groups complete out of issue order (different lengths, evaluation rounds in between, several
rollout workers), so the next batch is not simply "the first groups that completed". For batch
``k`` (trained at policy version ``k``):

* a group whose oldest sample was generated at version ``g`` has staleness ``k - g``;
* groups with staleness above ``max_staleness`` are *too stale*: dropped (and replaced by the
  caller) or, with the ``keep`` policy, used anyway - always counted;
* among the rest the oldest go first (they are the ones about to become too stale), ties in
  completion order; a batch is built only from ``per_step`` groups, never from fewer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReadyGroup:
    """A complete, accepted group waiting for a batch."""

    group_id: str
    oldest_version: int
    """Smallest policy_version_start among its samples."""


@dataclass(frozen=True)
class Selection:
    chosen: list[ReadyGroup]
    """The groups of the next batch, oldest first; empty when there are not enough yet."""
    too_stale: list[ReadyGroup]
    """Groups over the staleness bound (to drop under the ``drop`` policy)."""


def select_groups(
    ready: list[ReadyGroup], *, index: int, max_staleness: int, per_step: int, drop_stale: bool
) -> Selection:
    """Pick the groups of batch ``index`` from ``ready`` (in completion order)."""
    too_stale = [g for g in ready if index - g.oldest_version > max_staleness]
    usable = [g for g in ready if not drop_stale or index - g.oldest_version <= max_staleness]
    order = sorted(range(len(usable)), key=lambda i: (usable[i].oldest_version, i))
    chosen = [usable[i] for i in order[:per_step]] if len(usable) >= per_step else []
    return Selection(chosen=chosen, too_stale=too_stale if drop_stale else [])
