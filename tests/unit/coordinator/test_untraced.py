"""Evaluation prompts carry a fresh, unsampled trace context (no spans for them downstream)."""

from __future__ import annotations

from streamrl.common.telemetry.tracing import parse_traceparent
from streamrl.coordinator.traces import is_sampled, untraced


def test_evaluation_prompts_carry_an_unsampled_context() -> None:
    contexts = {untraced() for _ in range(3)}
    assert len(contexts) == 3
    for context in contexts:
        parsed = parse_traceparent(context)
        assert parsed is not None and not is_sampled(context)
