"""What a dead letter means for the run (pure): which group, evaluation prompt or batch was lost.

Every consumer dead-letters what it gives up on, with the original entry as the payload. For the
coordinator that is one of:

* a training prompt, trajectory or scored trajectory: its group can never complete - fail it and
  issue a replacement (``groups.py``);
* the same for an evaluation prompt (``is_eval``; its round is ``metadata["eval_version"]``): the
  prompt counts against its round, which closes without it (``evaluation.py``);
* a training batch the learner consumed untrained (its letter says ``BATCH_SKIPPED``): counted, never
  taken for a group (``batches.py``).

Anything else (a weights event, an undecodable entry, a batch the learner refused as a copy or as
one from the future) only counts as a dead letter: nothing the coordinator issued was lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import (
    BATCH_SKIPPED,
    DeadLetter,
    PromptWorkItem,
    ScoredTrajectory,
    TrainingBatch,
    Trajectory,
)


@dataclass(frozen=True)
class LostGroup:
    group_id: str


@dataclass(frozen=True)
class LostEvalPrompt:
    version: int
    """The evaluation round."""
    prompt_id: str


@dataclass(frozen=True)
class LostBatch:
    batch_id: str
    num_samples: int


Loss = LostGroup | LostEvalPrompt | LostBatch


def what_was_lost(letter: DeadLetter, *, batches_stream: str) -> Loss | None:
    """The group, evaluation prompt or batch that ``letter`` gives up on, or None."""
    try:
        inner = decode(letter.payload)
    except PoisonMessageError:
        return None
    if isinstance(inner, TrainingBatch):
        skipped = letter.stream == batches_stream and BATCH_SKIPPED in letter.error
        return LostBatch(inner.id, _num_samples(letter.error, len(inner.samples))) if skipped else None
    if isinstance(inner, PromptWorkItem):
        group, is_eval, metadata = inner.id, inner.is_eval, inner.metadata
    elif isinstance(inner, Trajectory | ScoredTrajectory):
        traj = inner.trajectory if isinstance(inner, ScoredTrajectory) else inner
        group, is_eval, metadata = traj.group_id, traj.is_eval, traj.metadata
    else:
        return None
    if is_eval:
        return LostEvalPrompt(int(metadata.get("eval_version", 0)), group)
    return LostGroup(group)


def _num_samples(error: str, in_payload: int) -> int:
    """The batch's samples: the learner's letter names them (``batch-7 (64 samples) ...``) since a large
    batch's payload keeps only its header."""
    head, _, rest = error.partition(" (")
    count, _, unit = rest.partition(" ")
    return int(count) if head and count.isdigit() and unit.startswith("samples)") else in_payload
