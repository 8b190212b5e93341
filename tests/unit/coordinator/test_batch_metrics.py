"""A batch's metrics carry the reward tier's latency and extra figures (pure)."""

from __future__ import annotations

import pytest
from coordinator_fakes import sample

from streamrl.coordinator.batch_metrics import RecordBatch, batch_stats


def test_reward_latency_and_extra_figures() -> None:
    samples = [
        sample("a", 0, 1.0, reward_latency_ms=10.0, extra={"reward/attempts": 1.0}),
        sample("a", 1, 0.0, reward_latency_ms=30.0, extra={"reward/attempts": 3.0, "rollout/acc": 9.0}),
        sample("b", 0, 1.0, reward_latency_ms=20.0),
    ]
    batch = RecordBatch(id="batch-0", index=0, samples=samples, policy_version=0, staleness=[0, 1, 2])
    stats = batch_stats(batch, elapsed_s=2.0, num_too_stale=4)
    assert (stats["reward/latency_ms_mean"], stats["reward/latency_ms_max"]) == (20.0, 30.0)
    assert stats["reward/attempts"] == 2.0  # over the samples that carry it
    assert stats["rollout/acc"] == pytest.approx(2 / 3)  # a scorer's figure never replaces the coordinator's
    assert (stats["coordinator/staleness_max"], stats["coordinator/samples_too_stale"]) == (2, 4)
    assert stats["rollout/tokens_per_s"] == 3.0  # 3 responses of 2 tokens in 2 s


def test_queue_wait_of_the_batch() -> None:
    """How long the batch's prompts waited before generation started (the progress line's queue_s)."""
    samples = [sample("a", 0, 1.0), sample("b", 0, 1.0)]
    samples[0].trajectory.timings["queue_s"] = 0.5
    samples[1].trajectory.timings["queue_s"] = 1.5
    batch = RecordBatch(id="batch-0", index=0, samples=samples, policy_version=0, staleness=[0, 0])
    assert batch_stats(batch, elapsed_s=1.0, num_too_stale=0)["rollout/queue_s_mean"] == 1.0
