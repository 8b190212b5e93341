"""Which batch the learner trains next (pure): duplicates, gaps and attempts, decided from plain values.

Batches carry an index (0, 1, ...) and are trained strictly in that order. What reaches the learner
may still hold a copy of a batch (a re-sent publication), a batch whose index is already taken by
other content, or skip an index (an entry lost before it was read). The rules:

* **behind** (index below the next one): a copy of what was consumed at that index (same
  :func:`fingerprint`: batch id, sample count and trajectory ids) is skipped quietly; anything else
  is a conflict, dead-lettered loudly naming both batches, never trained.
* **ahead** (index above the next one): while an entry for a missing index is still in the stream
  (pending for the learner - its delivery's reply was lost, or it came before a restart - or not yet
  delivered: a re-sent publication), the learner takes that entry first, the earliest such index, and
  trains it before the batch in hand: batches are trained in index order and nothing is dropped for
  arriving out of order. A batch whose index the coordinator has not reached yet (its
  ``state:batch_index`` counter, the index of the next batch it will publish, is not above it) comes
  from the future - forged, or a bug upstream - and is dead-lettered: the missing indices are still to
  be written. Otherwise the gap is confirmed - the coordinator has moved past those indices and no
  entry for them is left - and each missing index is recorded as lost (its version published with
  unchanged weights, as a skipped batch's) before the batch trains. The learner never waits on an
  index no one will write.
* **attempts**: every step is counted before it starts and again when it returns, so a step that
  killed the process (OOM-kill, segfault, a follower rank dying) shows as started but never
  finished; failures and kills together reach ``consumer.max_deliveries`` and the batch is skipped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from streamrl.common.messages import BatchManifest, TrainingBatch

Batch = TrainingBatch | BatchManifest
"""What ``batches`` carries: a manifest (the learner reads its payloads) or a whole batch."""

LOST = "(lost)"
"""The fingerprint recorded for an index that never reached the learner."""


def trajectory_ids(batch: Batch) -> list[str]:
    """The batch's trajectory ids, in order (a manifest names them without its payloads)."""
    if isinstance(batch, BatchManifest):
        return [s.trajectory_id for s in batch.samples]
    return [s.trajectory.id for s in batch.samples]


def fingerprint(batch: Batch) -> str:
    """What identifies a batch's content: ``{id} {num_samples} {digest of the trajectory ids}`` (the same for a
    manifest and the batch it names); a split manifest's digest is of its parts' keys (named under the build
    attempt's own token: the same for every copy of its entry, read or not, another for any other build)."""
    if isinstance(batch, BatchManifest) and batch.parts:
        parts = "\n".join(batch.parts).encode()
        return f"{batch.id} {batch.num_samples} {hashlib.sha256(parts).hexdigest()[:16]}"
    ids = "\n".join(trajectory_ids(batch)).encode()
    return f"{batch.id} {len(batch.samples)} {hashlib.sha256(ids).hexdigest()[:16]}"


def batch_name(record: str) -> str:
    """The batch id a fingerprint names (``(lost)`` for a lost index)."""
    return record.split(" ", 1)[0]


def behind_verdict(batch: Batch, next_index: int, record: str | None) -> str | None:
    """For a batch below ``next_index``: None when it is a copy of what was consumed at its index (skip it
    quietly), else the error of a conflict (dead-letter it). ``record``: the fingerprint of what the learner
    consumed at that index, None when no record is kept (acknowledged long ago)."""
    if record is None:
        return (
            f"{batch.id} is behind the learner, whose next batch is {next_index}, and index {batch.index} was "
            "acknowledged long ago (no record of its content is kept): not trained again"
        )
    if record == fingerprint(batch):
        return None
    if record == LOST:
        return (
            f"{batch.id} has index {batch.index}, which the learner recorded as lost (a later batch came first and "
            "no entry for it was left): not trained out of order"
        )
    return (
        f"{batch.id} has index {batch.index}, which the learner already consumed as {batch_name(record)} with other "
        f"content ({fingerprint(batch)} vs {record}): a conflicting copy, dead-lettered, not trained"
    )


@dataclass(frozen=True)
class Gap:
    """What to do with a batch above the learner's next index (:func:`gap_verdict`)."""

    lost: list[int] = field(default_factory=list)
    """Missing indices to record as lost before the batch trains (the gap is confirmed)."""
    first: tuple[int, str] | None = None
    """(index, entry id) of the earliest missing index still in the stream: train that entry first."""
    error: str | None = None
    """Why the batch is refused (dead-lettered): it comes from the future."""


def gap_verdict(batch: Batch, next_index: int, still_to_come: dict[int, str], published: int) -> Gap:
    """For a batch above ``next_index``: the earliest missing index still to come (train it first), else the
    error of a batch from the future, else the confirmed gap. ``still_to_come``: index -> entry id of the
    batches pending for the learner or not yet delivered; ``published``: the coordinator's ``batch_index``
    (every index below it was published)."""
    missing = range(next_index, batch.index)
    waiting = sorted((i, entry) for i, entry in still_to_come.items() if i in missing)
    if waiting:
        return Gap(first=waiting[0])
    if batch.index >= published:
        return Gap(
            error=(
                f"{batch.id} is ahead of the learner, whose next batch is {next_index}, and the coordinator has "
                f"published indices below {published} only: a batch from the future, never trained out of order"
            )
        )
    return Gap(lost=list(missing))


@dataclass(frozen=True)
class Attempts:
    """What the learner's Redis record says about one batch's steps."""

    started: int = 0
    finished: int = 0
    failed: int = 0
    error: str = ""

    @property
    def kills(self) -> int:
        """Steps started that never returned: the process died during them."""
        return max(0, self.started - self.finished)

    def exhausted(self, max_deliveries: int) -> bool:
        return self.failed + self.kills >= max_deliveries

    def reason(self) -> str:
        """Why the batch is skipped (the dead letter's words)."""
        seen = f"; last error seen: {self.error}" if self.error and not self.failed else ""
        killed = f"it killed its consumer {self.kills} times (the learner died during its step: out of memory?{seen})"
        if self.failed and self.kills:
            return f"its step failed {self.failed} times, last: {self.error}; and {killed}"
        if self.kills:
            return killed
        return f"its step failed {self.failed} times, last: {self.error}"
