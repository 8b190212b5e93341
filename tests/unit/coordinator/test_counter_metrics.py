"""The run counters become metrics under their documented names."""

from __future__ import annotations

from streamrl.coordinator import state as st
from streamrl.coordinator.progress import counter_metrics


def test_counter_metric_names() -> None:
    counters = {name: 1 for name in st.COUNTERS}
    metrics = counter_metrics(counters)
    assert metrics["reward/dead_lettered"] == 1 and metrics["coordinator/groups_timed_out"] == 1
    assert metrics["coordinator/eval_dead"] == 1 and "coordinator/samples_too_stale" not in metrics
