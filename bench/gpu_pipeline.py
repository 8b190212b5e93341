"""Part (c) of the GPU benchmark: ``streamrl up recipes/gpu_qwen2_0.5b.toml`` against TRL's GRPOTrainer.

Both sides train the same Qwen2-0.5B-shaped policy (random weights, the real Qwen2 tokenizer,
``examples/arithmetic/prepare.py`` preset ``qwen2_0.5b``) on the arithmetic task's prompts, with the
recipe's prompts per step, group size, new tokens, temperature and learning rate, in bfloat16, on
the same GPU, one after the other, evaluation off. A random policy rarely samples end-of-sequence,
so both sides generate ``max_new_tokens`` per sample (the reported mean lengths show it).

* streamrl: ``streamrl up`` of the recipe as it is (rollout engine and learner colocated on GPU 0,
  CUDA IPC weights, one step of overlap) for ``--pipeline-steps`` steps, as a subprocess. From its
  ``metrics.jsonl`` (learner rows carry ``learner/*``; the coordinator's batch rows carry
  ``rollout/*`` and ``coordinator/*``) and its log (the engine's ``update took`` lines).
* TRL: ``bench/e2e_trl.py --device cuda --dtype bfloat16 --bf16`` (GRPOTrainer with its own
  transformers generation, beta 0, one optimizer step per generation batch) for ``--trl-steps`` steps.

Per step is measured over the steady part: the time from the end of step ``skip`` to the end of
the last step, divided by the steps in between (``skip = max(2, steps // 10)``: start-up, compile
and allocator warm-up excluded on both sides), and as the median step; streamrl's last step, which
also saves and exports the final policy, is left out and reported as ``final_step_s``. Also reported: launch-to-finish wall time,
generated tokens/s, learner tokens/s (response tokens per second of learner step time), weight
sync (learner publish and engine update, median ms), peak GPU memory (``nvidia-smi`` polled every
0.5 s). The ratio is TRL seconds per step / streamrl seconds per step (target >= 2.5).

``--tiny`` runs the same code on a Qwen2-shaped model of 10M parameters on the CPU (3-4 steps a
side, float32, no compile): it proves the parsing, the subprocesses and the TRL call here.

    python bench/gpu.py --parts c [--pipeline-steps 60] [--trl-steps 12] [--tiny]
    python bench/gpu_pipeline.py [same options] [--out-dir DIR]      (this part alone)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gpu_qwen2_0.5b.toml"
TARGET_RATIO = 2.5
"""TRL seconds per step / streamrl seconds per step, at least (issue 28; issue 14 asked for 1.5)."""
ENGINE_UPDATE = re.compile(r"serving weights version (\d+) \(update took ([0-9.]+) s\)")
"""The rollout engine's log line for one weight update (the update itself)."""
ROLLOUT_SYNC = re.compile(r"now serving policy version (\d+) \(sync took ([0-9.]+) ms")
"""The rollout service's log line for one weight update (from the message to serving it, waits included)."""

TINY_OVERRIDES = [
    "--coordinator.prompts_per_step=4",
    "--coordinator.group_size=4",
    "--coordinator.sampling.max_new_tokens=8",
    "--consumer.count=16",
    "--rollout.engine.device=cpu",
    "--rollout.engine.dtype=float32",
    "--rollout.engine.max_num_seqs=16",
    "--learner.ds.dtype=fp32",
    "--learner.ds.zero_stage=0",
    "--learner.ds.compile=false",
    "--learner.ds.micro_batch_size=8",
    "--learner.ds.lr=1e-5",
    "--up.gpus={}",
    '--up.threads={"learner": 1, "rollout": 1, "reward": 1, "coordinator": 1}',
]
"""``--tiny``: the recipe at CPU size (the engine and learner on the CPU, float32, no compile)."""


@dataclass(frozen=True)
class PipelineSpec:
    """One run of part (c): the recipe with its overrides, and what TRL is given to match it."""

    recipe: str
    preset: str
    """prepare.py preset of the policy (qwen2_0.5b, or qwen2_tiny with --tiny)."""
    data_dir: str
    """Prepared folder (train.jsonl, model/)."""
    steps: int
    """streamrl steps (``total_steps``)."""
    trl_steps: int
    """TRL steps (generation batches)."""
    device: str
    """cuda, or cpu with --tiny."""
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    temperature: float
    lr: float
    overrides: list[str] = field(default_factory=list)
    """Overrides of the recipe for this run (tiny size, data paths, steps, run folder)."""
    streamrl_timeout_s: float = 330.0
    """Limit of the streamrl run; with TRL's, install (~30 s) and prepare (~30 s) inside one 10-minute device call."""
    trl_timeout_s: float = 180.0


def skip_steps(steps: int) -> int:
    """Steps left out of the steady window: start-up, compile and warm-up (``max(2, steps // 10)``)."""
    return max(2, steps // 10)


def steady_seconds_per_step(end_times: dict[int, float], skip: int) -> tuple[float | None, int, int]:
    """``(seconds per step, first step, last step)`` from the end time of each step: the span from the
    end of step ``skip`` (or of the first step logged, if later) to the end of the last step, divided
    by the steps in between. None when fewer than two steps are there."""
    steps = sorted(end_times)
    if len(steps) < 2:
        return None, 0, 0
    start = max((s for s in steps if s <= skip), default=steps[0])
    if start == steps[-1]:
        start = steps[-2]
    last = steps[-1]
    return (end_times[last] - end_times[start]) / (last - start), start + 1, last


def parse_memory_line(line: str) -> tuple[int, int] | None:
    """``"0, 1234"`` (``nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits``) -> (0, 1234)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


class GpuMemory:
    """Peak GPU memory (MiB per GPU) while a side runs: one ``nvidia-smi -lms`` process read in a thread.

    ``with GpuMemory() as mem: ...`` then ``mem.summary()``; None where there is no ``nvidia-smi``.
    """

    def __init__(self, interval_ms: int = 500, command: list[str] | None = None) -> None:
        smi = shutil.which("nvidia-smi")
        self.command = command or (
            [smi, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits", "-lms", str(interval_ms)]
            if smi
            else None
        )
        self.first: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuMemory:
        if self.command:
            self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True)
            self._thread.start()
        return self

    def _read(self, stream: TextIO) -> None:
        for line in stream:
            sample = parse_memory_line(line)
            if sample is not None:
                gpu, used = sample
                self.first.setdefault(gpu, used)
                self.peak[gpu] = max(self.peak.get(gpu, 0), used)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
        if self._thread is not None:
            self._thread.join(5)
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()  # the reader has seen its end: the pipe is ours to close

    def summary(self) -> dict[str, Any] | None:
        """``{"peak_mib", "before_mib", "peak_minus_before_mib"}``, each ``{gpu index: MiB}`` (the
        first sample is "before": taken as the side starts)."""
        if not self.command:
            return None
        return {
            "peak_mib": {str(k): v for k, v in sorted(self.peak.items())},
            "before_mib": {str(k): v for k, v in sorted(self.first.items())},
            "peak_minus_before_mib": {str(k): v - self.first[k] for k, v in sorted(self.peak.items())},
        }


def without_final_step(end_times: dict[int, float], steps: int) -> tuple[dict[int, float], float | None]:
    """The step end times without the run's last step, and that step's duration: the learner's last
    step also saves and exports the final policy (10-14 s for 0.5B on the H200), which is no
    per-step cost. Unchanged (and None) when the run did not reach ``steps``."""
    if steps not in end_times or steps - 1 not in end_times or len(end_times) < 3:
        return end_times, None
    return {k: t for k, t in end_times.items() if k != steps}, end_times[steps] - end_times[steps - 1]


def median_step_s(end_times: dict[int, float], first: int, last: int) -> float | None:
    """Median of the step durations (end-to-end gaps) of steps ``first..last`` (pure)."""
    gaps = [end_times[k] - end_times[k - 1] for k in range(first, last + 1) if k in end_times and k - 1 in end_times]
    return statistics.median(gaps) if gaps else None


def summarize_streamrl(rows: list[dict[str, Any]], log: str, steps: int) -> dict[str, Any]:
    """Per-step time, throughputs and weight-sync times of one ``streamrl up`` run, from its metrics
    rows and log (pure: tested on CPU)."""
    learner = {int(r["step"]): r for r in rows if "learner/step_s" in r}
    batches = {int(r["step"]): r for r in rows if "coordinator/batch_samples" in r}  # step = batch index
    skip = skip_steps(steps)
    ends, final_step_s = without_final_step({k: r["time"] for k, r in learner.items()}, steps)
    s_per_step, first, last = steady_seconds_per_step(ends, skip)
    out: dict[str, Any] = {
        "steps_done": len(learner),
        "steady_steps": [first, last],
        "s_per_step": s_per_step,
        "steps_per_s": 1.0 / s_per_step if s_per_step else None,
        "s_per_step_median": median_step_s(ends, first, last),
        "final_step_s": final_step_s,
    }
    steady = [r for k, r in learner.items() if first <= k <= last]
    if steady:
        busy = sum(r["learner/step_s"] for r in steady)
        out["learner_tokens_per_s"] = sum(r["learner/tokens"] for r in steady) / busy if busy else None
        out["learner_step_s_mean"] = busy / len(steady)
        out["learner_busy_frac"] = busy / (s_per_step * len(steady)) if s_per_step else None
    # batch index b holds the samples of step b + 1: the same window, in batch indices
    window = [batches[k] for k in sorted(batches) if first - 1 <= k <= last - 1]
    if len(window) >= 2:
        tokens = sum(r["rollout/response_len_mean"] * r["coordinator/batch_samples"] for r in window[1:])
        out["generated_tokens_per_s"] = tokens / max(window[-1]["time"] - window[0]["time"], 1e-9)
    if batches:
        out["response_len_mean"] = statistics.fmean(r["rollout/response_len_mean"] for r in batches.values())
        out["samples_per_step"] = statistics.fmean(r["coordinator/batch_samples"] for r in batches.values())
    # weight sync: every learner/weights* metric (the publish side), and the engine's update lines
    for key in sorted({k for r in steady for k in r if k.startswith("learner/weights")}):
        values = [r[key] for r in steady if key in r]
        out[f"{key.removeprefix('learner/')}_median_ms"] = 1000 * statistics.median(values)
    for name, pattern, to_ms in (("engine_update", ENGINE_UPDATE, 1000.0), ("rollout_sync", ROLLOUT_SYNC, 1.0)):
        times = [to_ms * float(t) for v, t in pattern.findall(log) if first <= int(v) <= last]
        if times:
            out[f"{name}_median_ms"] = statistics.median(times)
            out[f"{name}_max_ms"] = max(times)
    if learner:
        out["first_step_at"] = min(r["time"] for r in learner.values())
    return out


def summarize_trl(result: dict[str, Any], steps: int) -> dict[str, Any]:
    """Per-step time of a ``bench/e2e_trl.py`` result over the same steady window rule (pure)."""
    ends = {i + 1: t for i, t in enumerate(result.get("step_end_s", []))}
    s_per_step, first, last = steady_seconds_per_step(ends, skip_steps(steps))
    samples = result["settings"]["prompts_per_step"] * result["settings"]["group_size"]
    done = result["steps"]
    return {
        "steps_done": done,
        "steady_steps": [first, last],
        "s_per_step": s_per_step,
        "s_per_step_median": median_step_s(ends, first, last),
        "steps_per_s": 1.0 / s_per_step if s_per_step else None,
        "rl_s": result["rl_s"],
        "generated_tokens_per_s": result["generated_tokens_per_s"],
        "response_len_mean": result["generated_tokens"] / max(done * samples, 1),
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    """This part's options (``bench/gpu.py`` parses them from the arguments it does not know itself)."""
    parser.add_argument("--recipe", default=None, help="streamrl recipe (default recipes/gpu_qwen2_0.5b.toml)")
    parser.add_argument("--pipeline-steps", type=int, default=None, help="streamrl steps (default 60; 4 with --tiny)")
    parser.add_argument(
        "--trl-steps", type=int, default=None, help="TRL steps (default 12; 3 with --tiny; 0: streamrl alone)"
    )
    parser.add_argument("--pipeline-timeout-s", type=float, default=None, help="streamrl's limit (default 330 s)")
    parser.add_argument("--trl-timeout-s", type=float, default=None, help="TRL's limit (default 180 s)")
    parser.add_argument("--tiny", action="store_true", help="a 10M-parameter Qwen2 on the CPU: checks this script")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="--SECTION.FIELD=VALUE",
        help="one more override of the recipe for streamrl (repeatable), e.g. --override=--learner.ds.compile=false",
    )


def spec_from_args(args: argparse.Namespace) -> PipelineSpec:
    """The run's settings: the recipe (``--recipe``), at CPU size with ``--tiny``, and what TRL gets."""
    from streamrl.common.config import apply_overrides, read_recipe

    tiny = bool(getattr(args, "tiny", False))
    recipe = str(getattr(args, "recipe", None) or RECIPE)
    data = read_recipe(recipe)
    prepared = data.get("prepare", {})
    preset = "qwen2_tiny" if tiny else prepared.get("preset", "qwen2_0.5b")
    data_dir = str(ROOT / ("runs/gpu_qwen2_tiny_data" if tiny else prepared.get("out_dir", "runs/gpu_qwen2_data")))
    steps = getattr(args, "pipeline_steps", None) or (4 if tiny else 60)
    if steps < 3:
        raise ValueError(f"--pipeline-steps must be >= 3 (two warm-up steps leave the steady window), got {steps}")
    overrides = list(TINY_OVERRIDES) if tiny else []
    if tiny and "weights_transport" in data.get("learner", {}):
        overrides.append("--learner.weights_transport=zmq")  # CUDA IPC needs the GPU
    overrides += [
        *getattr(args, "override", []),
        f"--total_steps={steps}",
        f"--coordinator.dataset.path={data_dir}/train.jsonl",
        f"--coordinator.dataset.tokenizer={data_dir}/model",
        f"--rollout.engine.model={data_dir}/model",
        f"--learner.model={data_dir}/model",
    ]
    resolved = apply_overrides(data, overrides, env={})
    coordinator = resolved["coordinator"]
    return PipelineSpec(
        recipe=recipe,
        preset=preset,
        data_dir=data_dir,
        steps=steps,
        trl_steps=(3 if tiny else 12) if getattr(args, "trl_steps", None) is None else args.trl_steps,
        device="cpu" if tiny else "cuda",
        prompts_per_step=coordinator["prompts_per_step"],
        group_size=coordinator["group_size"],
        max_new_tokens=coordinator["sampling"]["max_new_tokens"],
        temperature=coordinator["sampling"].get("temperature", 1.0),
        lr=resolved["learner"]["ds"]["lr"],
        overrides=overrides,
        streamrl_timeout_s=getattr(args, "pipeline_timeout_s", None) or 330.0,
        trl_timeout_s=getattr(args, "trl_timeout_s", None) or 180.0,
    )


def child_env() -> dict[str, str]:
    """Both sides' environment: local files only (no hub look-ups, no telemetry)."""
    return {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


def prepare(spec: PipelineSpec) -> dict[str, Any]:
    """Model and data through ``examples/arithmetic/prepare.py`` (idempotent: nothing redone if there)."""
    started = time.perf_counter()
    cmd = [
        sys.executable,
        str(ROOT / "examples/arithmetic/prepare.py"),
        spec.recipe,
        f"--prepare.preset={spec.preset}",
        f"--prepare.out_dir={spec.data_dir}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"prepare failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "prepare_s": round(time.perf_counter() - started, 1)}


def run_streamrl(spec: PipelineSpec, work: Path) -> dict[str, Any]:
    """``streamrl up`` of the recipe until it finishes (or ``streamrl_timeout_s``: then SIGINT, and the
    steps done so far are reported); the summary of its metrics and log."""
    run_dir = work / "streamrl"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log_path = work / "streamrl.log"
    cmd = [
        sys.executable,
        "-m",
        "streamrl.ops.cli",
        "up",
        spec.recipe,
        *spec.overrides,
        f"--run_dir={run_dir}",
        f"--run_id=gpu-pipeline-{int(time.time())}",
    ]
    timed_out = False
    with GpuMemory() as memory, log_path.open("w") as log:
        launched = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(spec.streamrl_timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGINT)  # the launcher stops every service cleanly
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        finished = time.time()
    text = log_path.read_text(errors="replace")
    rows = (
        [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        if (run_dir / "metrics.jsonl").exists()
        else []
    )
    out = summarize_streamrl(rows, text, spec.steps)
    first = out.pop("first_step_at", None)
    out.update(
        exit_code=code,
        timed_out=timed_out,
        wall_s=round(finished - launched, 1),
        launch_to_first_step_s=round(first - launched, 1) if first else None,
        gpu_memory=memory.summary(),
        log=str(log_path),
        metrics=str(run_dir / "metrics.jsonl"),
    )
    if code != 0 or timed_out:
        out["log_tail"] = text[-4000:]
    return out


def run_trl(spec: PipelineSpec, work: Path) -> dict[str, Any]:
    """``bench/e2e_trl.py`` on the same model, prompts, batch and lengths, evaluation off (one held-out
    prompt evaluated once before the clock starts: the script always evaluates step 0). It stops by
    itself after ``trl_steps`` or 60% of ``trl_timeout_s`` of RL time; killed at ``trl_timeout_s``."""
    gpu = spec.device == "cuda"
    cmd = [
        sys.executable,
        str(ROOT / "bench/e2e_trl.py"),
        "--data-dir",
        spec.data_dir,
        "--prompts-per-step",
        str(spec.prompts_per_step),
        "--group-size",
        str(spec.group_size),
        "--max-new-tokens",
        str(spec.max_new_tokens),
        "--temperature",
        str(spec.temperature),
        "--lr",
        str(spec.lr),
        "--max-steps",
        str(spec.trl_steps),
        "--time-budget-s",
        str(0.6 * spec.trl_timeout_s),
        "--eval-every-steps",
        str(spec.trl_steps + 1),
        "--num-eval",
        "1",
        "--num-threads",
        str(min(os.cpu_count() or 2, 16) if gpu else 2),
        "--device",
        spec.device,
        "--dtype",
        "bfloat16" if gpu else "float32",
    ]
    if gpu:
        cmd.append("--bf16")
    log_path = work / "trl.log"
    with GpuMemory() as memory, log_path.open("w") as log:
        launched = time.time()
        try:
            proc = subprocess.run(
                cmd,
                cwd=ROOT,
                env=child_env(),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                timeout=spec.trl_timeout_s,
            )
        except subprocess.TimeoutExpired:
            return {
                "timed_out": True,
                "wall_s": round(time.time() - launched, 1),
                "log": str(log_path),
                "log_tail": log_path.read_text(errors="replace")[-4000:],
            }
        finished = time.time()
        log.write(proc.stdout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {
            "exit_code": proc.returncode,
            "log": str(log_path),
            "log_tail": log_path.read_text(errors="replace")[-4000:],
        }
    result = json.loads(lines[-1])
    return {
        **summarize_trl(result, spec.trl_steps),
        "exit_code": 0,
        "wall_s": round(finished - launched, 1),
        "gpu_memory": memory.summary(),
        "log": str(log_path),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Part (c): prepare, streamrl, TRL, the ratio. Files go to ``args.out_dir`` when it is set. A side
    that failed or ran out of time is named in ``errors`` (the part is then reported as failed), the
    other side's figures are kept."""
    spec = spec_from_args(args)
    work = ROOT / "runs" / "gpu_pipeline" / spec.preset
    work.mkdir(parents=True, exist_ok=True)
    out_dir = getattr(args, "out_dir", None)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    partial: dict[str, Any] = {"spec": asdict(spec)}

    def record(name: str, result: dict[str, Any], files: dict[str, Path]) -> None:
        """Print a side's figures and keep them and its files in ``out_dir`` at once (a device call cut
        short keeps them)."""
        partial[name] = result
        print(f"gpu_pipeline: {name} {json.dumps({k: v for k, v in result.items() if k != 'log_tail'})}", flush=True)
        if out_dir:
            (Path(out_dir) / "pipeline-partial.json").write_text(json.dumps(partial, indent=2))
            for target, path in files.items():
                if path.exists():
                    shutil.copy(path, Path(out_dir) / target)

    prepared = prepare(spec)
    record("prepared", prepared, {})
    streamrl = run_streamrl(spec, work)
    record(
        "streamrl",
        streamrl,
        {"pipeline-streamrl.log": work / "streamrl.log", "pipeline-metrics.jsonl": work / "streamrl" / "metrics.jsonl"},
    )
    trl: dict[str, Any] = {"skipped": "--trl-steps 0"}
    if spec.trl_steps > 0:
        trl = run_trl(spec, work)
        record("trl", trl, {"pipeline-trl.log": work / "trl.log"})
    ours, theirs = streamrl.get("s_per_step"), trl.get("s_per_step")
    ratio = theirs / ours if ours and theirs else None
    errors = [
        f"{side}: exit code {r.get('exit_code')}{', timed out' if r.get('timed_out') else ''}"
        for side, r in (("streamrl", streamrl), ("trl", trl))
        if "skipped" not in r and (r.get("exit_code") != 0 or r.get("timed_out"))
    ]
    return {
        "spec": asdict(spec),
        "prepared": prepared,
        "streamrl": streamrl,
        "trl": trl,
        "trl_s_per_step_over_streamrl": ratio,
        "target": TARGET_RATIO,
        "met": ratio is not None and ratio >= TARGET_RATIO,
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    parser.add_argument("--out-dir", default=None, help="copy the logs and metrics here")
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
