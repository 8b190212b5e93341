"""Weighted combination of several scorers (pure)."""

from __future__ import annotations

import pytest

from streamrl.reward.combine import WeightedResult, combine
from streamrl.reward.scorers.base import ScorerResult


def test_weighted_sum_and_weighted_mean_score() -> None:
    math = ScorerResult(rewards=[1.0, 0.0], scores=[1.0, 0.0], extra=[{"parsed": 1.0}, {"parsed": 0.0}])
    rm = ScorerResult(rewards=[-2.0, 4.0], scores=[0.2, 0.9], extra=[{}, {}])
    out = combine([WeightedResult("math", 3.0, math), WeightedResult("rm", 1.0, rm)])
    assert [c.reward for c in out] == [3.0 * 1.0 + -2.0, 3.0 * 0.0 + 4.0]
    assert out[0].score == pytest.approx((3.0 * 1.0 + 0.2) / 4.0)
    assert out[1].score == pytest.approx((3.0 * 0.0 + 0.9) / 4.0)
    assert out[0].extra == {
        "math/reward": 1.0,
        "math/score": 1.0,
        "math/parsed": 1.0,
        "rm/reward": -2.0,
        "rm/score": 0.2,
    }


def test_weight_zero_is_logged_not_trained_on() -> None:
    main = ScorerResult(rewards=[0.5], scores=[0.5], extra=[{}])
    probe = ScorerResult(rewards=[100.0], scores=[1.0], extra=[{"len": 9.0}])
    (out,) = combine([WeightedResult("main", 1.0, main), WeightedResult("probe", 0.0, probe)])
    assert (out.reward, out.score) == (0.5, 0.5)
    assert out.extra["probe/reward"] == 100.0 and out.extra["probe/len"] == 9.0


def test_mismatched_lengths_and_bad_weights_fail() -> None:
    a = ScorerResult(rewards=[1.0, 2.0], scores=[1.0, 1.0], extra=[{}, {}])
    b = ScorerResult(rewards=[1.0], scores=[1.0], extra=[{}])
    with pytest.raises(ValueError, match="scorer 'b' returned 1 rewards"):
        combine([WeightedResult("a", 1.0, a), WeightedResult("b", 1.0, b)])
    with pytest.raises(ValueError, match="weights must sum to > 0"):
        combine([WeightedResult("a", 0.0, a)])
    with pytest.raises(ValueError, match="at least one"):
        combine([])
