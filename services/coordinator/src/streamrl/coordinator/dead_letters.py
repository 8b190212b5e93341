"""What a dead letter means for the run (pure): which group, evaluation prompt or batch was lost.

Every consumer dead-letters what it gives up on, with the original entry as the payload. For the
coordinator that is one of:

* a training prompt, trajectory or scored trajectory: its group can never complete - fail it and
  issue a replacement (``groups.py``);
* the same for an evaluation prompt (``is_eval``; its round is ``metadata["eval_version"]``): the
  prompt counts against its round, which closes without it (``evaluation.py``);
* a training batch (the learner could not train it): counted, never taken for a group (``batches.py``).

Anything else (a weights event, an entry too large or undecodable from another stream) only counts
as a dead letter.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import DeadLetter, PromptWorkItem, ScoredTrajectory, TrainingBatch, Trajectory


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
    """The batch id, or ``entry {id}`` when the payload could not be read (cut as too large)."""
    num_samples: int


Loss = LostGroup | LostEvalPrompt | LostBatch


def what_was_lost(letter: DeadLetter, *, batches_stream: str) -> Loss | None:
    """The group, evaluation prompt or batch that ``letter`` gives up on, or None."""
    try:
        inner = decode(letter.payload)
    except PoisonMessageError:
        return LostBatch(f"entry {letter.entry_id}", 0) if letter.stream == batches_stream else None
    if isinstance(inner, TrainingBatch):
        return LostBatch(inner.id, len(inner.samples))
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
