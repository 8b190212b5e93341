"""The autoscaling decision: up at once to what the backlog asks (after the up cooldown), down one
replica at a time after the backlog stayed low a whole down cooldown, always within the bounds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from streamrl.ops.autoscale import AutoscaleConfig, ScalePolicy, ScaleState, decide

POLICY = ScalePolicy(min_replicas=1, max_replicas=4, target_backlog=10, scale_up_cooldown_s=5, scale_down_cooldown_s=20)


def _run(backlogs: list[tuple[float, int]], start: int = 1) -> list[tuple[float, int]]:
    """(time, backlog) looks -> (time, count) after each."""
    state, count, out = ScaleState(), start, []
    for now, waiting in backlogs:
        count = decide(POLICY, waiting, count, state, now)
        out.append((now, count))
    return out


def test_a_burst_scales_up_at_once_to_what_it_asks_capped_at_max() -> None:
    assert _run([(0, 35)]) == [(0, 4)]  # ceil(35 / 10) = 4
    assert _run([(0, 500)]) == [(0, 4)]
    assert _run([(0, 15)]) == [(0, 2)]


def test_a_second_scale_up_waits_for_the_up_cooldown() -> None:
    assert _run([(0, 15), (2, 40), (4.9, 40), (5, 40)]) == [(0, 2), (2, 2), (4.9, 2), (5, 4)]


def test_scale_down_needs_a_whole_cooldown_of_low_backlog_then_goes_one_at_a_time() -> None:
    looks = [(0, 40), (10, 0), (25, 0), (30, 0), (45, 0), (50, 0), (70, 0), (90, 0)]
    assert _run(looks) == [(0, 4), (10, 4), (25, 4), (30, 3), (45, 3), (50, 2), (70, 1), (90, 1)]


def test_a_backlog_that_comes_back_resets_the_low_clock() -> None:
    looks = [(0, 40), (30, 0), (45, 40), (50, 0), (65, 0), (70, 0)]
    # low from 30, high again at 45: the low clock restarts at 50 and a step down waits until 70
    assert _run(looks) == [(0, 4), (30, 4), (45, 4), (50, 4), (65, 4), (70, 3)]


def test_counts_outside_the_bounds_come_back_within_them() -> None:
    assert _run([(0, 0)], start=0) == [(0, 1)]  # below min: raised (an idle tier keeps min_replicas)
    assert _run([(0, 100)], start=9) == [(0, 4)]  # set above max by hand: brought back


def test_bad_policies_and_services_are_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match=r"min_replicas \(5\) is above max_replicas \(2\)"):
        ScalePolicy(min_replicas=5, max_replicas=2)
    with pytest.raises(ValidationError, match=r"\['learner'\] cannot be autoscaled"):
        AutoscaleConfig(enabled=True, services={"learner": ScalePolicy()})
    with pytest.raises(ValidationError, match="names no service"):
        AutoscaleConfig(enabled=True)
