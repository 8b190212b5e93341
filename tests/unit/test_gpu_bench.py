"""bench/gpu.py and bench/gpu_pipeline.py without a GPU: the steady window, the metric and log parsing,
the GPU memory line parser, the run settings and per-part options (the poller's process and the driver's
report: tests/integration/gpu)."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402
import gpu_pipeline as pipeline  # noqa: E402


def test_skip_steps_leaves_out_start_up() -> None:
    assert [pipeline.skip_steps(n) for n in (3, 12, 20, 60, 100)] == [2, 2, 2, 6, 10]


def test_steady_seconds_per_step_spans_the_steps_after_skip() -> None:
    ends = {1: 100.0, 2: 130.0, 3: 132.0, 4: 134.0, 5: 136.5}
    assert pipeline.steady_seconds_per_step(ends, skip=2) == (6.5 / 3, 3, 5)
    assert pipeline.steady_seconds_per_step({4: 10.0, 5: 12.0, 6: 13.0}, skip=2) == (1.5, 5, 6)  # none <= skip
    assert pipeline.steady_seconds_per_step({1: 1.0, 2: 3.0}, skip=2) == (2.0, 2, 2)  # too few: the last interval
    assert pipeline.steady_seconds_per_step({1: 1.0}, skip=2) == (None, 0, 0)


def test_parse_memory_line() -> None:
    assert pipeline.parse_memory_line("0, 1234\n") == (0, 1234)
    assert pipeline.parse_memory_line("[N/A]") is None
    assert pipeline.parse_memory_line("0, [N/A]") is None


def _learner_row(step: int, time: float) -> dict[str, Any]:
    return {
        "step": step,
        "time": time,
        "learner/step_s": 0.5,
        "learner/tokens": 1000.0,
        "learner/weights_publish_s": 0.004 + step / 1000,
        "learner/loss/policy": 0.0,
    }


def _batch_row(index: int, time: float) -> dict[str, Any]:
    return {"step": index, "time": time, "rollout/response_len_mean": 128.0, "coordinator/batch_samples": 256}


def test_summarize_streamrl_over_the_steady_window() -> None:
    # steps 1..6, step k ends at 10 + 2k (step 1 at 12 after a slow start); batch b is made at 9.5 + 2b
    rows = [_learner_row(k, 10.0 + 2 * k) for k in range(1, 7)] + [_batch_row(b, 9.5 + 2 * b) for b in range(6)]
    log = "\n".join(
        f"rollout-0 | INFO x: serving weights version {v} (update took 0.00{v} s)\n"
        f"rollout-0 | INFO y: now serving policy version {v} (sync took {10 + v} ms)"
        for v in range(1, 7)
    )
    out = pipeline.summarize_streamrl(rows, log, steps=7)  # stopped before its last (saving) step
    assert out["steady_steps"] == [3, 6] and out["steps_done"] == 6 and out["final_step_s"] is None
    assert out["s_per_step"] == pytest.approx(2.0) and out["steps_per_s"] == pytest.approx(0.5)
    assert out["learner_tokens_per_s"] == pytest.approx(2000.0)
    assert out["learner_busy_frac"] == pytest.approx(0.25)
    # batches 2..5 are the steady window's: 3 batches of 256 x 128 tokens in 6 s
    assert out["generated_tokens_per_s"] == pytest.approx(3 * 256 * 128 / 6.0)
    assert out["response_len_mean"] == 128.0 and out["samples_per_step"] == 256
    assert out["weights_publish_s_median_ms"] == pytest.approx(8.5)  # steps 3..6: 7, 8, 9, 10 ms
    assert out["engine_update_median_ms"] == pytest.approx(4.5) and out["engine_update_max_ms"] == pytest.approx(6.0)
    assert out["rollout_sync_median_ms"] == pytest.approx(14.5) and out["rollout_sync_max_ms"] == 16.0
    assert out["first_step_at"] == 12.0


def test_the_final_save_is_not_a_step() -> None:
    """The last step also saves and exports the policy (16.6 s of it on the H200, 2026-12-03): reported
    apart, not averaged into the steps (before: 1.2-1.3 s/step where the steps took 0.96)."""
    ends = {k: 10.0 + 2 * k for k in range(1, 11)}
    ends[10] = ends[9] + 14.0
    rows = [_learner_row(k, t) for k, t in ends.items()] + [_batch_row(b, 9.5 + 2 * b) for b in range(10)]
    out = pipeline.summarize_streamrl(rows, "", steps=10)
    assert out["s_per_step"] == pytest.approx(2.0) and out["s_per_step_median"] == pytest.approx(2.0)
    assert out["final_step_s"] == pytest.approx(14.0) and out["steady_steps"] == [3, 9]


def test_summarize_streamrl_of_a_run_that_died_early() -> None:
    out = pipeline.summarize_streamrl([_batch_row(0, 5.0)], "", steps=60)
    assert out["s_per_step"] is None and out["steps_done"] == 0 and "generated_tokens_per_s" not in out


def test_summarize_trl() -> None:
    result = {
        "steps": 4,
        "rl_s": 20.0,
        "generated_tokens_per_s": 100.0,
        "generated_tokens": 4 * 16 * 8,
        "step_end_s": [8.0, 12.0, 15.0, 18.0],
        "settings": {"prompts_per_step": 4, "group_size": 4},
    }
    out = pipeline.summarize_trl(result, steps=4)
    assert out["steady_steps"] == [3, 4] and out["s_per_step"] == pytest.approx(3.0)
    assert out["response_len_mean"] == pytest.approx(8.0)


def test_spec_from_the_recipe_gives_trl_the_same_batch() -> None:
    spec = pipeline.spec_from_args(argparse.Namespace(tiny=False, recipe=None, pipeline_steps=None, trl_steps=None))
    assert (spec.preset, spec.device, spec.steps, spec.trl_steps) == ("qwen2_0.5b", "cuda", 60, 12)
    assert (spec.prompts_per_step, spec.group_size, spec.max_new_tokens, spec.lr) == (32, 8, 128, 1e-6)
    assert spec.data_dir == str(ROOT / "runs/gpu_qwen2_data")
    assert "--total_steps=60" in spec.overrides and not any(o.startswith("--up.") for o in spec.overrides)


def test_tiny_spec_runs_on_the_cpu() -> None:
    spec = pipeline.spec_from_args(argparse.Namespace(tiny=True, pipeline_steps=5, trl_steps=None))
    assert (spec.preset, spec.device, spec.steps, spec.trl_steps) == ("qwen2_tiny", "cpu", 5, 3)
    assert (spec.prompts_per_step, spec.group_size, spec.max_new_tokens) == (4, 4, 8)
    assert {"--rollout.engine.device=cpu", "--up.gpus={}", "--learner.weights_transport=zmq"} <= set(spec.overrides)


def test_parse_args_checks_parts_and_picks_the_report_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    args = gpu.parse_args(["--parts", "c,a", "--tiny", "--part-a-flag=1"])
    assert args.parts == ["c", "a"] and args.tiny and args.rest == ["--part-a-flag=1"]
    assert args.out_dir == str(tmp_path)
    with pytest.raises(SystemExit):
        gpu.parse_args(["--parts", "d"])


def fake_part(monkeypatch: pytest.MonkeyPatch, name: str, run: Any, add_args: Any = None) -> None:
    module = types.ModuleType(name)
    module.run = run  # type: ignore[attr-defined]
    if add_args is not None:
        module.add_args = add_args  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)


def test_a_part_gets_its_own_options_and_the_drivers(monkeypatch: pytest.MonkeyPatch) -> None:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--prompts", type=int, default=64)
        parser.add_argument("--new-tokens", type=int, default=256)
        parser.add_argument("--tiny", action="store_true")

    fake_part(monkeypatch, "gpu_test_opts", lambda args: {}, add_args)
    args = gpu.parse_args(["--tiny", "--prompts", "8", "--pipeline-steps=50"])
    namespace, unknown = gpu.part_args(sys.modules["gpu_test_opts"], args)
    assert (namespace.prompts, namespace.new_tokens, namespace.tiny) == (8, 256, True)
    assert unknown == {"--pipeline-steps=50"}
    namespace, unknown = gpu.part_args(pipeline, args)
    assert namespace.pipeline_steps == 50 and unknown == {"--prompts", "8"}
