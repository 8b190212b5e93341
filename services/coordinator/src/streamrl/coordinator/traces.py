"""The coordinator's spans: where a prompt group's trace starts, and what its samples waited for.

Span names and attribute keys are :mod:`streamrl.common.telemetry.trace_schema`'s:

* ``coordinator.issue``: root of a training prompt group's trace, started when its prompt is issued
  (``issuing.py``). The sampling decision (``[tracing]``) is taken there, once per group, and
  travels to every service in the PromptWorkItem's traceparent.
* ``coordinator.group_wait`` and ``coordinator.batch_wait``, per traced sample, recorded when its
  batch is built (``batches.py``): from the sample's arrival in its group buffer to its group's
  completion (the arrival of its last member), then from there to the batch. The arrival time is
  kept with the stored sample (``Trajectory.timings[STORED_AT]``, traced samples only). The batch
  wait's traceparent replaces the sample's in the batch, so the learner's training span hangs below.
* ``coordinator.batch``: root of each batch's trace (always recorded); its traceparent is the batch's.

Evaluation prompts are not traced: they carry a fresh *unsampled* context (:func:`untraced`), so no
service records a span for them (an empty traceparent would make each service start a trace of its
own). Their samples are never trained, so their traces could never be complete, and a round issues
all its prompts in one burst, which would skew the training pipeline's queue-wait and generation
percentiles in ``streamrl trace``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from streamrl.common.messages import ScoredRecord
from streamrl.common.telemetry.trace_schema import (
    BATCH_ID,
    BATCH_WAIT,
    GROUP_ID,
    GROUP_WAIT,
    TRAJECTORY_ID,
    VERSION_START,
)
from streamrl.common.telemetry.tracing import SAMPLED, Tracing, format_traceparent, parse_traceparent

STORED_AT = "stored_at"
"""``Trajectory.timings`` key: Unix time (s) the coordinator stored a traced sample in its group buffer."""


def is_sampled(traceparent: str) -> bool:
    """The trace is recorded (its sampled flag is set); False for an empty or unsampled context."""
    parsed = parse_traceparent(traceparent)
    return parsed is not None and bool(parsed[2] & SAMPLED)


def untraced() -> str:
    """A fresh unsampled trace context: every span below it is left out, in every service."""
    return format_traceparent(random.getrandbits(128) or 1, random.getrandbits(64) or 1, 0)


def note_arrival(sample: ScoredRecord, now: float) -> None:
    """Keep the time ``sample`` is stored in its buffer with it (in place), when its trace is recorded."""
    if is_sampled(sample.traceparent):
        sample.trajectory.timings[STORED_AT] = now


def record_waits(tracing: Tracing, samples: Sequence[ScoredRecord], *, batch_id: str, built_at: float) -> None:
    """Record the group-wait and batch-wait spans of the traced ``samples`` (complete groups) going into
    batch ``batch_id`` at ``built_at``, and give each sample its batch-wait span's traceparent (in place).

    A sample with no store time (stored by a coordinator before it kept one) keeps its traceparent.
    """
    traced = [s for s in samples if is_sampled(s.traceparent) and STORED_AT in s.trajectory.timings]
    complete_at: dict[str, float] = {}
    for s in traced:
        group, arrived = s.trajectory.group_id, s.trajectory.timings[STORED_AT]
        complete_at[group] = max(complete_at.get(group, arrived), arrived)
    for s in traced:
        traj = s.trajectory
        complete = complete_at[traj.group_id]
        waited = tracing.record(
            GROUP_WAIT,
            s.traceparent,
            start_s=traj.timings[STORED_AT],
            end_s=complete,
            attributes={GROUP_ID: traj.group_id, TRAJECTORY_ID: traj.id},
        )
        s.traceparent = tracing.record(
            BATCH_WAIT,
            waited,
            start_s=complete,
            end_s=built_at,
            attributes={BATCH_ID: batch_id, TRAJECTORY_ID: traj.id, VERSION_START: traj.policy_version_start},
        )
