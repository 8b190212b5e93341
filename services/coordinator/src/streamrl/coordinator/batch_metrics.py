"""The metrics of one training batch, from its samples alone (pure).

What the rollout and reward tiers measured travels in the samples: rewards and scores, response
lengths, partial-rollout versions, how long prompts queued before generation
(``timings["queue_s"]``), the reward tier's latency (``ScoredTrajectory.reward_latency_ms``)
and its extra figures (``ScoredTrajectory.extra``, e.g. ``reward/attempts``: each key's mean over the
samples that carry it). The coordinator is where they meet a step number, so they are reported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamrl.common.messages import ScoredRecord


@dataclass
class RecordBatch:
    """A batch as the coordinator built it: its scored records (the manifest names their payloads)."""

    id: str
    index: int
    samples: list[ScoredRecord]
    policy_version: int
    staleness: list[int]
    created_at: float = 0.0
    traceparent: str = ""


def batch_stats(batch: RecordBatch, *, elapsed_s: float, num_too_stale: int, waited_s: float = 0.0) -> dict[str, float]:
    """Metrics of ``batch``; ``elapsed_s`` since the previous batch (tokens/s), ``num_too_stale``
    samples dropped since then as over max_staleness, ``waited_s`` it waited for in-flight groups whose
    last batch it was (``coordinator.batch_wait_s``)."""
    samples = batch.samples

    def mean(values: list[float]) -> float:
        return float(np.mean(values)) if values else 0.0

    # the model's tokens: a multi-turn response also holds the environment's (loss mask 0)
    lengths = [float(s.trajectory.num_loss_tokens) for s in samples]
    latencies = [s.reward_latency_ms for s in samples]
    stats = {
        "rollout/reward_mean": mean([s.reward for s in samples]),
        "rollout/acc": mean([s.score for s in samples]),
        "rollout/response_len_mean": mean(lengths),
        "rollout/truncated_frac": mean([float(s.trajectory.truncated) for s in samples]),
        "rollout/partial_frac": mean(
            [float(s.trajectory.policy_version_end != s.trajectory.policy_version_start) for s in samples]
        ),
        "rollout/tokens_per_s": float(sum(lengths) / max(elapsed_s, 1e-6)),
        "coordinator/staleness_mean": mean([float(x) for x in batch.staleness]),
        "coordinator/staleness_max": float(max(batch.staleness, default=0)),
        "coordinator/samples_too_stale": float(num_too_stale),
        "coordinator/batch_wait_s": float(waited_s),
        "coordinator/batch_samples": float(len(samples)),
        "rollout/generation_started_min": min(
            (s.trajectory.timings.get("started_at", 0.0) for s in samples), default=0.0
        ),
        "rollout/queue_s_mean": mean([s.trajectory.timings.get("queue_s", 0.0) for s in samples]),
        "reward/latency_ms_mean": mean(latencies),
        "reward/latency_ms_max": float(max(latencies, default=0.0)),
    }
    extra: dict[str, list[float]] = {}
    for s in samples:
        for name, value in s.extra.items():
            extra.setdefault(name, []).append(value)
    for name, values in sorted(extra.items()):
        stats.setdefault(name, mean(values))  # a scorer's figure never overwrites the coordinator's own
    return stats
