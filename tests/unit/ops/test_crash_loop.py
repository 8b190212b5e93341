"""``streamrl up``'s restart rules without processes: restarts are on by default, a crash loop or a spent
``max_restarts`` ends them, and what is shown of the replica's last output."""

from __future__ import annotations

import pytest

from streamrl.ops.local_backend import crash_verdict, last_error
from streamrl.ops.up_config import UpConfig


def test_restarts_are_on_by_default_and_bounded_by_the_crash_loop_limit() -> None:
    up = UpConfig()
    assert (up.crash_loop_limit, up.crash_loop_window_s, up.max_restarts) == (5, 600.0, {})
    verdicts = [crash_verdict(k, k - 1, up.crash_loop_limit, up.crash_loop_window_s, None) for k in range(1, 6)]
    assert verdicts[:4] == [None] * 4  # crashes 1-4 within the window: restarted
    assert verdicts[4] == "crashed 5 times within 600 s (up.crash_loop_limit = 5)"


def test_max_restarts_bounds_a_service_over_the_whole_run() -> None:
    assert crash_verdict(1, 9, 5, 600, 10) is None  # crashes far apart: only the total counts
    assert crash_verdict(1, 10, 5, 600, 10) == "no restart left (up.max_restarts = 10)"
    assert crash_verdict(1, 0, 5, 600, 0) == "no restart left (up.max_restarts = 0)"
    assert crash_verdict(1, 0, 1, 600, None) is not None  # crash_loop_limit = 1: restarts off


def test_a_crash_loop_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="crash_loop_limit"):
        UpConfig.model_validate({"crash_loop_limit": 0})


def test_the_last_error_line_is_the_last_that_reads_as_one() -> None:
    lines = ["loading", "Traceback (most recent call last):", "  File x", "ValueError: bad scorer", "bye"]
    assert last_error(lines) == "ValueError: bad scorer"
    assert last_error(["just a line"]) == "just a line"
    assert last_error([]) == ""
