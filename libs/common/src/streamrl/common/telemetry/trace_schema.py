"""Span names and attribute keys of streamrl traces, defined once: services write them, ``streamrl trace`` reads them.

A prompt group's trace is one chain per sample, each span the child of the one before it (the parent
travels as the ``traceparent`` of the message between two services)::

    coordinator.issue           root, one per prompt group (PromptWorkItem.traceparent)
    └ rollout.queue             prompt issued -> picked up by a rollout worker (start = issued_at)
      └ rollout.generate        one per sample (Trajectory.traceparent)
        └ reward.score          one per delivery attempt (ScoredTrajectory.traceparent: the one that committed)
          └ coordinator.group_wait    scored -> its group complete
            └ coordinator.batch_wait  group complete -> in a training batch (the sample's traceparent in the batch)
              └ learner.train         the sample in a training step: staleness, correction weights

Per-step traces, recorded whatever the sampling ratio::

    coordinator.batch           root of a batch's trace (TrainingBatch.traceparent)
    └ learner.step              links to every sample span it consumed
    learner.weights_publish     children of one context per weight version
    rollout.weights_load        (:func:`streamrl.common.telemetry.tracing.weights_traceparent`), one per worker

A redelivered entry gets one span per attempt under the same parent (``streamrl.attempt``); only the
attempt whose outputs were committed has children.
"""

from __future__ import annotations

# span names
ISSUE = "coordinator.issue"
QUEUE = "rollout.queue"
GENERATE = "rollout.generate"
REWARD = "reward.score"
GROUP_WAIT = "coordinator.group_wait"
BATCH_WAIT = "coordinator.batch_wait"
TRAIN = "learner.train"
BATCH = "coordinator.batch"
STEP = "learner.step"
WEIGHTS_PUBLISH = "learner.weights_publish"
WEIGHTS_LOAD = "rollout.weights_load"

PER_STEP_ROOTS = frozenset({BATCH, STEP, WEIGHTS_PUBLISH, WEIGHTS_LOAD})
"""Spans recorded even when their trace starts unsampled by ``ratio`` sampling: a few per step."""

STAGES: dict[str, str] = {
    "queue wait": QUEUE,
    "generation": GENERATE,
    "reward": REWARD,
    "group wait": GROUP_WAIT,
    "batch wait": BATCH_WAIT,
    "train": TRAIN,
    "weight publish": WEIGHTS_PUBLISH,
    "weight load": WEIGHTS_LOAD,
}
"""Stages of the latency breakdown, in pipeline order: label -> span name."""

# attribute keys
RUN_ID = "streamrl.run_id"
"""Resource attribute: the run."""
ATTEMPT = "streamrl.attempt"
"""Delivery attempt of the entry being handled (1 = first delivery)."""
KEEP = "streamrl.keep"
"""Why the sample's trace is worth keeping under tail sampling: ``failed``, ``stale``, ``slow`` (comma-joined)."""
GROUP_ID = "streamrl.group_id"
TRAJECTORY_ID = "streamrl.trajectory_id"
BATCH_ID = "streamrl.batch_id"
STEP_INDEX = "streamrl.step"
"""Learner step."""
POLICY_VERSION = "streamrl.policy_version"
"""Version when the span happened: issued at (coordinator), trained by (learner), published / loaded (weights)."""
VERSION_START = "streamrl.policy_version_start"
"""Behaviour version: the one that generated the sample's first token."""
VERSION_END = "streamrl.policy_version_end"
"""Version that generated the sample's last token (differs from the start under partial rollout)."""
PARTIAL = "streamrl.partial_rollout"
"""The sample was generated across a weight update."""
VERSIONS = "streamrl.policy_versions"
"""Partial rollouts only: the version of each response token, run-length, as ``index:version`` pairs
joined by commas (``0:3,412:4``: tokens 0-411 from version 3, 412 on from 4)."""
ENGINE = "streamrl.engine"
NUM_PROMPT_TOKENS = "streamrl.num_prompt_tokens"
NUM_RESPONSE_TOKENS = "streamrl.num_response_tokens"
FINISH_REASON = "streamrl.finish_reason"
SCORER = "streamrl.reward.scorer"
REWARD_VALUE = "streamrl.reward.value"
RETRIES = "streamrl.reward.retries"
"""Backend calls retried for this sample."""
REMOTE_LATENCY_MS = "streamrl.reward.remote_latency_ms"
STALENESS = "streamrl.staleness"
"""Learner version minus behaviour version of a trained sample."""
CORRECTION_WEIGHT = "streamrl.correction_weight"
"""Mean importance-sampling correction weight over the sample's tokens."""
MASKED_FRACTION = "streamrl.masked_fraction"
"""Fraction of the sample's tokens masked out by the off-policy correction."""
NUM_SAMPLES = "streamrl.num_samples"
NUM_BYTES = "streamrl.weights.num_bytes"
WEIGHTS_PATH = "streamrl.weights.path"
"""How weights travelled: ``zmq``, ``ipc``, ``broadcast``."""
