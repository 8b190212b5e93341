"""bench/gpu_staleness.py's figures: per-step time without the first and last step, time to a target."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from gpu_staleness import summarize


def _rows() -> list[dict[str, float]]:
    # learner steps at 10 (start-up), then every 0.5 s, the last one 5 s later (the final save)
    times = [10.0, 10.5, 11.0, 11.5, 12.0, 17.0]
    rows: list[dict[str, float]] = [
        {"step": i, "time": t, "learner/step_s": 0.4, "learner/staleness_mean": 1.0, "learner/staleness_max": 1}
        for i, t in enumerate(times)
    ]
    rows += [{"step": 0, "time": 9.0, "eval/acc": 0.3}, {"step": 4, "time": 12.2, "eval/acc": 0.6}]
    return rows


def test_the_final_save_and_start_up_stay_off_the_per_step_figure() -> None:
    out = summarize(_rows(), launched_at=0.0, ended_at=18.0, target=0.5)
    assert out["s_per_step"] == pytest.approx(0.5)
    assert out["final_step_s"] == pytest.approx(5.0)
    assert out["first_step_after_launch_s"] == pytest.approx(10.0)
    assert out["wall_s"] == pytest.approx(18.0)


def test_time_to_target_is_the_first_evaluation_at_or_above_it() -> None:
    out = summarize(_rows(), launched_at=0.0, ended_at=18.0, target=0.5)
    assert (out["target_step"], out["launch_to_target_s"], out["rl_to_target_s"]) == (4, 12.2, 2.2)
    assert summarize(_rows(), 0.0, 18.0, target=0.9)["launch_to_target_s"] is None


def test_too_few_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="only 2 learner steps"):
        summarize(_rows()[:2], 0.0, 1.0, target=None)
