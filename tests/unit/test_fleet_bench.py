"""bench/fleet.py's pure parts: H200-equivalent arithmetic, run sizing, the sustained criterion, CPU
accounting from /proc text, the bottleneck line, and the sweep's size and id helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import fleet  # noqa: E402
import fleet_model as fm  # noqa: E402
import fleet_probes  # noqa: E402


def test_a_thousand_gpus_at_the_assumed_rate_are_a_thousand_h200_equivalents() -> None:
    spec = fm.FleetSpec()
    rate = fm.trajectories_per_s(1000, spec)
    assert rate == pytest.approx(1000 * 5000 / 8192)  # 610.4 trajectories/s
    assert fm.h200_equivalents(rate, spec) == pytest.approx(1000)
    # GPUs twice as fast are worth twice as many H200s; trajectories twice as long halve the rate
    fast = fm.FleetSpec(tokens_per_s=10_000)
    assert fm.h200_equivalents(fm.trajectories_per_s(1000, fast), fast) == pytest.approx(2000)
    assert fm.trajectories_per_s(1000, fm.FleetSpec(response_tokens=16_384)) == pytest.approx(rate / 2)


def test_generation_time_is_the_gpus_sequences_times_their_length_over_its_rate() -> None:
    spec = fm.FleetSpec(tokens_per_s=4096, response_tokens=8192, group_size=8, seqs_per_gpu=16)
    assert spec.groups_per_gpu == 2
    assert spec.generation_s == pytest.approx(32.0)


@pytest.mark.parametrize(
    "kwargs", [{"tokens_per_s": 0}, {"response_tokens": 0}, {"seqs_per_gpu": 12, "group_size": 8}, {"group_size": 0}]
)
def test_a_bad_spec_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        fm.FleetSpec(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("num_gpus,step_s,staleness", [(64, 2.0, 4), (1000, 2.0, 4), (1000, 30.0, 1), (8, 0.5, 8)])
def test_sizing_keeps_the_learner_ahead_and_the_fleet_fed(num_gpus: int, step_s: float, staleness: int) -> None:
    spec = fm.FleetSpec()
    sizing = fm.size_run(num_gpus, spec, max_staleness=staleness, learner_step_s=step_s)
    assert sizing.batch_samples == sizing.prompts_per_step * spec.group_size
    learner_rate = sizing.batch_samples / step_s
    assert learner_rate >= 1.25 * fm.trajectories_per_s(num_gpus, spec) - 1e-9
    # one batch's worth may sit complete, waiting: the rest of the admission window feeds the GPUs
    assert staleness * sizing.prompts_per_step >= 2.0 * num_gpus * spec.groups_per_gpu
    assert sizing.in_flight_groups_max == (staleness + 1) * sizing.prompts_per_step


def test_sizing_refuses_the_synchronous_mode() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        fm.size_run(8, fm.FleetSpec(), max_staleness=0, learner_step_s=1.0)


def test_backlog_growth_is_the_fitted_slope_over_the_span() -> None:
    assert fm.backlog_growth([(0.0, 10.0), (2.0, 14.0), (4.0, 18.0), (6.0, 22.0)]) == pytest.approx(12.0)
    assert fm.backlog_growth([(0.0, 5.0), (2.0, 9.0), (4.0, 5.0), (6.0, 9.0)]) == pytest.approx(2.4)  # noise
    assert fm.backlog_growth([(0.0, 30.0), (10.0, 0.0)]) == pytest.approx(-30.0)
    assert fm.backlog_growth([(1.0, 7.0)]) == 0.0


def test_judge_names_every_reason() -> None:
    ok = fm.judge(utilization=0.97, growth={"scored": 3.0}, handled={"scored": 1000.0}, problems=[])
    assert ok == fm.Verdict(sustained=True, reasons=[])
    starved = fm.judge(utilization=0.80, growth={}, handled={}, problems=[])
    assert not starved.sustained and "80.0%" in starved.reasons[0]
    growing = fm.judge(utilization=1.0, growth={"scored": 60.0}, handled={"scored": 1000.0}, problems=[])
    assert not growing.sustained and "scored backlog grew by 60" in growing.reasons[0]
    # a stream that handled few entries may still grow by one (batches: a batch in the learner's hands)
    assert fm.judge(utilization=1.0, growth={"batches": 1.0}, handled={"batches": 3.0}, problems=[]).sustained
    died = fm.judge(utilization=1.0, growth={}, handled={}, problems=["coordinator exited with 1"])
    assert died.reasons == ["coordinator exited with 1"]


def test_cpu_ticks_are_read_past_a_command_name_with_spaces_and_parentheses() -> None:
    line = "4242 (python (sim) x) S 1 4242 4242 0 -1 4194304 100 0 0 0 731 269 0 0 20 0 3 0 100 0 0"
    assert fm.process_ticks(line) == 731 + 269
    stat = "cpu  100 5 50 800 20 3 2 10 0 0\ncpu0 50 2 25 400 10 1 1 5 0 0\n"
    assert fm.machine_ticks(stat) == (100 + 5 + 50 + 3 + 2 + 10, 3 + 2)


def test_bottleneck_names_a_saturated_single_threaded_process_before_the_machine() -> None:
    single = {"redis", "coordinator"}
    line = fm.bottleneck({"coordinator": 0.95, "redis": 0.6, "others": 0.4}, 2, single)
    assert line.startswith("coordinator saturates its core")
    assert "machine's 2 cores are saturated" in fm.bottleneck({"rollout_sims": 1.2, "redis": 0.7}, 2, single)
    assert fm.bottleneck({"redis": 0.3}, 2, single).startswith("no CPU saturated")


def test_sweep_helpers() -> None:
    assert fleet_probes.next_id("1700000000000-7") == "1700000000000-8"
    assert fleet_probes.id_order("12-3") < fleet_probes.id_order("12-10") < fleet_probes.id_order("13-0")
    assert [fleet.round_gpus(n, 8) for n in (1, 12, 13, 640.0, 1000)] == [8, 16, 16, 640, 1000]

    def step(n: int, ok: bool, others: float, load: float, **extra: str) -> dict[str, object]:
        return {"num_gpus": n, "sustained": ok, "cpu_cores": {"others": others}, "load_1m_before": load, **extra}

    steps = [
        step(512, True, 0.3, 3.0),
        step(1024, False, 0.0, 1.0),
        step(768, True, 1.2, 0.5),
        step(768, False, 0.1, 2.5, rerun="yes"),
        step(2048, True, 0.0, 0.1, diagnostic="profile"),
    ]
    # 768 counts by its less disturbed measurement (the rerun: others used 0.1 cores in its window, not
    # sustained); diagnostics are never judged
    assert fleet.largest(steps) == steps[0]
    assert fleet.largest(steps[:3]) == steps[2]


def test_a_components_cpu_is_fitted_as_fixed_plus_per_trajectory_and_projected_to_one_core() -> None:
    # 0.05 cores whatever the rate, plus 1.2 ms per trajectory
    points = [(rate, 0.05 + 0.0012 * rate) for rate in (40.0, 80.0, 160.0)]
    fixed, per_rate = fm.linear_fit(points)  # type: ignore[misc]
    assert (fixed, per_rate) == (pytest.approx(0.05), pytest.approx(0.0012))
    assert fm.core_ceiling(fixed, per_rate) == pytest.approx(0.95 / 0.0012)
    assert fm.linear_fit([(80.0, 0.1), (80.0, 0.2)]) is None  # one rate: no slope
    assert fm.linear_fit([(80.0, 0.1)]) is None
    assert fm.core_ceiling(0.2, 0.0) is None and fm.core_ceiling(1.1, 0.001) is None
