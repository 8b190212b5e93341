"""What a dead letter means for the run (pure): which group, evaluation prompt or batch was lost.

Every consumer dead-letters what it gives up on, with the original entry as the payload. For the
coordinator that is one of:

* a training prompt, trajectory or scored trajectory: its group can never complete - fail it and
  issue a replacement (``groups.py``);
* the same for an evaluation prompt (``is_eval``; its round is ``metadata["eval_version"]``): the
  prompt counts against its round, which closes without it (``evaluation.py``);
* a training batch (a BatchManifest, or a whole TrainingBatch) the learner consumed untrained (its letter
  says ``BATCH_SKIPPED``; it published that index's version anyway): its groups are dropped, counted,
  never taken for a group, and a manifest's sample hashes deleted (``batches.py``);
* a training batch the learner refused without consuming it (it came out of order, or conflicts with
  what the learner consumed at its index): no version comes for it, so the coordinator sends it again
  (``batches.py``) and counts it dropped only once that was refused too often. A batch whose payload
  the letter cut (too large to keep whole) is named by the letter's error and counted dropped.

Anything else (a weights event, an undecodable entry of another stream) only counts as a dead
letter: nothing the coordinator issued was lost.

A letter about a batch is acted on only when the learner wrote it: with the run's weights key, one not signed
with it (:func:`streamrl.common.weights.auth.check_letter`) is a :class:`ForgedLetter` - any service's credential
can write to ``dead``, and an honoured batch letter deletes the samples it names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import (
    BATCH_SKIPPED,
    BatchManifest,
    DeadLetter,
    Message,
    PromptWorkItem,
    ScoredRecord,
    ScoredTrajectory,
    TrainingBatch,
    Trajectory,
    TrajectoryRecord,
)
from streamrl.common.weights.auth import LetterAuthError, check_letter

BATCH_ID = re.compile(r"\bbatch-\d+\b")
"""A batch id in a letter's error (the learner names the batch it gives up on)."""


@dataclass(frozen=True)
class LostGroup:
    group_id: str
    payloads: tuple[str, ...] = ()
    """The payload the lost record named (deleted: no buffer holds its record)."""


@dataclass(frozen=True)
class LostEvalPrompt:
    version: int
    """The evaluation round."""
    prompt_id: str
    payloads: tuple[str, ...] = ()
    """The payload the lost record named (deleted)."""


@dataclass(frozen=True)
class LostBatch:
    """A batch consumed untrained (or unreadable): its groups are dropped."""

    batch_id: str
    num_samples: int
    num_groups: int | None
    """None when the letter kept no samples to count them from."""
    buffers: tuple[str, ...] = ()
    """The hashes holding its samples (a manifest's), to delete."""


@dataclass(frozen=True)
class RefusedBatch:
    """A batch the learner refused without consuming it: ``payload`` is the whole entry, to send again."""

    batch_id: str
    num_samples: int
    num_groups: int
    payload: bytes
    buffers: tuple[str, ...] = ()
    """The hashes holding its samples (a manifest's): deleted if it is counted dropped."""


@dataclass(frozen=True)
class ForgedLetter:
    """A letter about a batch not signed with the run's key: nothing is done for it but to say so."""

    reason: str


Loss = LostGroup | LostEvalPrompt | LostBatch | RefusedBatch | ForgedLetter


def what_was_lost(letter: DeadLetter, *, batches_stream: str, key: bytes | None, run_id: str) -> Loss | None:
    """The group, evaluation prompt or batch that ``letter`` gives up on, or None. ``key``: the run's weights
    key, which a letter about a batch (of ``batches_stream``) must be signed with for run ``run_id`` (None: every
    letter is believed)."""
    if letter.stream == batches_stream:
        try:
            check_letter(letter, key, run_id=run_id)
        except LetterAuthError as e:
            return ForgedLetter(str(e))
    return _lost(letter, batches_stream)


def _lost(letter: DeadLetter, batches_stream: str) -> Loss | None:
    """What a letter believed gives up on (see :func:`what_was_lost`)."""
    try:
        inner: Message = decode(letter.payload)
    except PoisonMessageError:
        named = BATCH_ID.search(letter.error)
        if letter.stream == batches_stream and named:  # a batch's letter, its payload cut
            return LostBatch(named.group(0), _num_samples(letter.error[named.start() :], 0), None)
        return None
    if isinstance(inner, TrainingBatch | BatchManifest):
        if letter.stream != batches_stream:
            return None
        if isinstance(inner, BatchManifest):
            groups = len({s.group_id for s in inner.samples})
            buffers = tuple(inner.buffers)
        else:
            groups = len({s.trajectory.group_id for s in inner.samples})
            buffers = ()
        num = inner.num_samples if isinstance(inner, BatchManifest) else len(inner.samples)
        if BATCH_SKIPPED in letter.error or not num:
            return LostBatch(inner.id, _num_samples(letter.error, num), groups or None, buffers)
        return RefusedBatch(inner.id, num, groups, letter.payload, buffers)
    payloads: tuple[str, ...] = ()
    if isinstance(inner, PromptWorkItem):
        group, is_eval, metadata = inner.id, inner.is_eval, inner.metadata
    elif isinstance(inner, Trajectory | ScoredTrajectory | TrajectoryRecord | ScoredRecord):
        traj = inner.trajectory if isinstance(inner, ScoredTrajectory | ScoredRecord) else inner
        group, is_eval, metadata = traj.group_id, traj.is_eval, traj.metadata
        if isinstance(traj, TrajectoryRecord):
            payloads = (traj.payload_key,)
    else:
        return None
    if is_eval:
        return LostEvalPrompt(int(metadata.get("eval_version", 0)), group, payloads)
    return LostGroup(group, payloads)


def _num_samples(error: str, in_payload: int) -> int:
    """The batch's samples: the learner's letter names them (``batch-7 (64 samples) ...``) since a large
    batch's payload keeps only its header."""
    head, _, rest = error.partition(" (")
    count, _, unit = rest.partition(" ")
    return int(count) if head and count.isdigit() and unit.startswith("samples)") else in_payload
