"""The learner's spans (names and attribute keys: :mod:`streamrl.common.telemetry.trace_schema`).

* ``learner.step``, one per training step (per attempt: a retried step's attempts are siblings carrying
  ``streamrl.attempt``), child of the batch's trace (``TrainingBatch.traceparent``), always recorded,
  linked to every traced sample it consumed (each sample's traceparent in the batch; unsampled samples
  have no recorded span to link to). It carries the step's batch-level correction means, and fails
  with the error when the step fails or the batch is skipped untrained.
* ``learner.train``, one per traced sample, child of the sample's traceparent, spanning the step: the
  sample's staleness (learner version - behaviour version at its first token; the numbers
  ``learner/staleness_*`` summarise), the learner version, the behaviour versions, its mean correction
  weight and masked fraction (when an off-policy correction is on), and a keep mark when it is stale
  or its trajectory (issue to training) was slow.
* ``learner.weights_publish``, one per version served, under
  :func:`~streamrl.common.telemetry.tracing.weights_traceparent` (run, version), with bytes and path.

Only rank 0 (the service) records spans. Per-sample work is done only for samples whose trace is
sampled (:func:`traced_rows` reads the flag in each traceparent, ~1 us a sample): their rows get
correction figures from the trainer and a training span here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from streamrl.common.messages import TrainingBatch, Trajectory
from streamrl.common.telemetry.trace_schema import (
    BATCH_ID,
    CORRECTION_WEIGHT,
    MASKED_FRACTION,
    NUM_SAMPLES,
    POLICY_VERSION,
    STALENESS,
    STEP,
    STEP_INDEX,
    TRAIN,
    TRAJECTORY_ID,
    VERSION_END,
    VERSION_START,
)
from streamrl.common.telemetry.tracing import SAMPLED, Attributes, Span, Tracing, parse_traceparent


class SampleCorrection(NamedTuple):
    """What the off-policy correction did to one sample's tokens."""

    weight_mean: float
    """Mean correction weight over its valid tokens (0 where a token was masked)."""
    masked_frac: float
    """Fraction of its valid tokens whose weight the correction zeroed."""


def traced_rows(batch: TrainingBatch) -> list[int]:
    """Rows of ``batch`` whose sample's trace is recorded (sampled flag set)."""
    rows = []
    for i, sample in enumerate(batch.samples):
        parsed = parse_traceparent(sample.traceparent)
        if parsed is not None and parsed[2] & SAMPLED:
            rows.append(i)
    return rows


def issued_at(traj: Trajectory) -> float | None:
    """Unix time (s) the sample's prompt was issued, from the rollout tier's timings (None without them)."""
    timings = traj.timings
    if "started_at" not in timings or "queue_s" not in timings:
        return None
    return timings["started_at"] - timings["queue_s"]


def start_step(tracing: Tracing, batch: TrainingBatch, rows: list[int], *, version: int) -> Span:
    """The step span of ``batch`` trained at learner ``version``, linked to its traced ``rows``."""
    attributes: Attributes = {
        BATCH_ID: batch.id,
        STEP_INDEX: version,
        POLICY_VERSION: version,
        NUM_SAMPLES: len(batch.samples),
    }
    return tracing.span(
        STEP, batch.traceparent, attributes=attributes, links=[batch.samples[i].traceparent for i in rows]
    )


def step_figures(metrics: Mapping[str, float]) -> Attributes:
    """The step's batch-level correction means (when a correction is on), for its step span."""
    keys = {CORRECTION_WEIGHT: "learner/correction/weight_mean", MASKED_FRACTION: "learner/correction/masked_frac"}
    return {attribute: metrics[key] for attribute, key in keys.items() if key in metrics}


def record_train_spans(
    tracing: Tracing,
    batch: TrainingBatch,
    rows: list[int],
    *,
    version: int,
    staleness: list[int],
    corrections: Mapping[int, SampleCorrection],
    start_s: float,
    end_s: float,
) -> None:
    """One training span per traced row of ``batch``, spanning the step (``start_s`` to ``end_s``)."""
    for i in rows:
        traj = batch.samples[i].trajectory
        attributes: dict[str, str | int | float] = {
            TRAJECTORY_ID: traj.id,
            STEP_INDEX: version,
            POLICY_VERSION: version,
            STALENESS: staleness[i],
            VERSION_START: traj.policy_version_start,
            VERSION_END: traj.policy_version_end,
        }
        if i in corrections:
            attributes[CORRECTION_WEIGHT] = corrections[i].weight_mean
            attributes[MASKED_FRACTION] = corrections[i].masked_frac
        span = tracing.span(TRAIN, batch.samples[i].traceparent, attributes=attributes, start_s=start_s)
        issued = issued_at(traj)
        span.mark_keep(staleness=staleness[i], duration_s=None if issued is None else end_s - issued)
        span.end(end_s)
