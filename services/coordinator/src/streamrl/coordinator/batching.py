"""Which complete groups go into the next training batch (pure).

Groups complete out of issue order (different lengths, evaluation rounds in between, several
rollout workers), so the next batch is not simply "the first groups that completed". For batch
``k`` (trained at policy version ``k``):

* a group whose oldest sample was generated at version ``g`` has staleness ``k - g``;
* groups with staleness above ``max_staleness`` are *too stale*: dropped (and replaced by the
  caller) or, with the ``keep`` policy, used anyway - always counted;
* among the rest the oldest go first (they are the ones about to become too stale), ties in
  completion order; a batch is built only from ``per_step`` groups, never from fewer;
* a group generated at ``g`` can be trained at batch ``g + max_staleness`` at the latest (its *last
  batch*). While a group whose last batch is ``k`` is still in flight (being generated or scored), batch
  ``k`` is not filled with a group whose last batch is later: it waits for the in-flight one, which would
  otherwise be too stale for every batch after ``k`` - generated, scored and thrown away because its
  scorer was slow. An in-flight group's generation version is not known yet: the version its prompt
  requires (``g >= required``) stands for it. The caller bounds the wait (``coordinator.batch_wait_s``).
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
    """The groups of the next batch, oldest first; empty when there are not enough yet, or while it waits."""
    too_stale: list[ReadyGroup]
    """Groups over the staleness bound (to drop under the ``drop`` policy)."""
    waiting_for: int = 0
    """In-flight groups whose last batch this is, that the batch waits for (``chosen`` is empty then)."""


def last_batch(generation_version: int, max_staleness: int) -> int:
    """The last batch index a sample generated at ``generation_version`` may be trained in."""
    return generation_version + max_staleness


def last_chance(in_flight_versions: list[int], *, index: int, max_staleness: int) -> int:
    """How many in-flight groups (by the version each requires) have batch ``index`` as their last batch."""
    return sum(1 for v in in_flight_versions if last_batch(v, max_staleness) == index)


def select_groups(
    ready: list[ReadyGroup],
    *,
    index: int,
    max_staleness: int,
    per_step: int,
    drop_stale: bool,
    last_chance_in_flight: int = 0,
) -> Selection:
    """Pick the groups of batch ``index`` from ``ready`` (in completion order). ``last_chance_in_flight``: the
    in-flight groups whose last batch is ``index`` (:func:`last_chance`); while there are any, no group that
    could wait for a later batch takes a place in this one (the batch waits)."""
    too_stale = [g for g in ready if index - g.oldest_version > max_staleness]
    usable = [g for g in ready if not drop_stale or index - g.oldest_version <= max_staleness]
    order = sorted(range(len(usable)), key=lambda i: (usable[i].oldest_version, i))
    chosen = [usable[i] for i in order[:per_step]] if len(usable) >= per_step else []
    spare = sum(1 for g in chosen if last_batch(g.oldest_version, max_staleness) > index)
    if last_chance_in_flight and spare:
        return Selection(chosen=[], too_stale=too_stale if drop_stale else [], waiting_for=last_chance_in_flight)
    return Selection(chosen=chosen, too_stale=too_stale if drop_stale else [])
