"""streamrl against TRL's GRPOTrainer on one GPU: the 7B-shaped LoRA recipe, both launched as a user would.

Issue 37, item 5. One run, one machine, one side after the other:

* streamrl: ``streamrl up recipes/gpu_7b_lora.toml`` (vLLM and the DeepSpeed learner colocated on GPU 0,
  rank-16 adapters on every linear layer, only the adapter sent to vLLM each version, one step of
  overlap with TIS correction), as a subprocess. Step end times: the learner's rows in ``metrics.jsonl``
  (a step's row is written after its checkpoint and, at the last step, the final export).
* TRL: ``bench/gpu_vs_trl_7b_trl.py`` (GRPOTrainer, peft ``LoraConfig``, vLLM in colocate mode: vLLM in
  the training process, the adapter merged into the base and loaded into vLLM before each generation),
  as a subprocess. Step end times: a ``TrainerCallback`` writing one JSON line per step and save.

Both sides get the same policy folder (a Qwen2.5-7B-shaped model with random weights and the real Qwen2
tokenizer, built by ``examples/arithmetic/prepare.py``; ``--model DIR`` takes yours), the arithmetic
task's prompts and reward, and the same LoRA rank / alpha / targets, prompts per step, group size, new
tokens, context length, sampling, optimizer (AdamW, betas, eps, weight decay, lr, schedule, clipping),
micro-batch and accumulation, gradient checkpointing, loss aggregation, precision, seed, steps and
checkpoint period. The settings are read back from what each side will run - ``streamrl up --dry-run``
for streamrl, the ``GRPOConfig`` and ``LoraConfig`` TRL builds for TRL - and the bench refuses to run,
naming the setting, when one differs (:data:`PARITY_FIELDS`). What differs by design is recorded
(:data:`DESIGN_DIFFERENCES`). A random policy rarely samples end-of-sequence, so both sides generate
``max_new_tokens`` per sample (the generated tokens are reported).

Measured per side: the median step time over the steps after ``--warmup-steps`` (at least
``--min-measured`` of them: 20 on the GPU), and the wall time from launch to step ``--wall-step``
(30) done, its checkpoint and, at the last step, the final save included: each side pays its own
start, compile and saves. Ratios are TRL / streamrl: ``per_step_ratio`` (TRL s/step over ours) and
``wall_ratio``. Also peak GPU memory (``nvidia-smi``) and generated tokens/s.

    python bench/gpu_vs_trl_7b.py [--steps 30] [--model DIR] [--out DIR]            (a GPU)
    python bench/gpu_vs_trl_7b.py --smoke                                           (this harness on a CPU)

``--smoke`` runs everything on the CPU with a tiny Qwen2 (the same tokenizer), streamrl's transformers
engine, TRL without vLLM, a few steps: it proves the launch, the parsing and the report, not a speed.
On the GPU machine run it through ``bench/gpu_vs_trl_7b.sh`` (installs the kits first). Writes
``gpu_vs_trl_7b-<UTC date>.json`` (``gpu_vs_trl_7b_smoke-cpu-...`` for the smoke) to ``--out``, else
``$OUT``, else ``bench/results``, and prints it as one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gpu_7b_lora.toml"
TRL_SCRIPT = ROOT / "bench" / "gpu_vs_trl_7b_trl.py"
sys.path.insert(0, str(ROOT / "bench"))

PARITY_FIELDS = (
    "model",
    "device",
    "dtype",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "prompts_per_step",
    "group_size",
    "max_new_tokens",
    "max_model_len",
    "temperature",
    "top_p",
    "top_k",
    "steps",
    "seed",
    "lr",
    "scheduler",
    "warmup_steps",
    "optimizer",
    "betas",
    "eps",
    "weight_decay",
    "grad_clip",
    "micro_batch_size",
    "grad_accum",
    "updates_per_step",
    "gradient_checkpointing",
    "kl_coef",
    "clip_eps_low",
    "clip_eps_high",
    "loss_aggregation",
    "advantage",
    "vllm",
    "gpu_memory_utilization",
    "max_num_seqs",
    "checkpoint_every",
)
"""Settings both sides must share, in one vocabulary; the bench refuses to run when one differs."""

DESIGN_DIFFERENCES = {
    "schedule": "streamrl: generation of step k+1 overlaps training of step k (max_staleness 1, TIS); "
    "TRL: generate, then train, in turn (its vLLM importance-sampling correction on)",
    "weight sync": "streamrl: the adapter alone (CUDA IPC), vLLM serves it as a LoRA on its base; "
    "TRL: the adapter merged into the base, the full merged weights loaded into vLLM, every step",
    "processes": "streamrl: four services on Redis streams (embedded Redis), learner and vLLM in their own "
    "processes; TRL: one process",
    "prompt order": "the same prompts; streamrl's coordinator shuffles them with its seed, TRL reads them "
    "in the harness's seeded order",
    "checkpoint contents": "streamrl: adapter and optimizer state every checkpoint_every steps and the final "
    "export; TRL: its checkpoint (adapter, optimizer, trainer state) every save_steps and save_model at the end",
}
"""How the two sides differ by design: what the comparison is about, recorded in the report."""

SMOKE_OVERRIDES = [
    "--coordinator.prompts_per_step=4",
    "--coordinator.group_size=4",
    "--coordinator.sampling.max_new_tokens=8",
    "--rollout.engine.max_model_len=32",
    "--consumer.count=16",
    "--consumer.max_in_flight=32",
    "--rollout.engine.type=hf",
    "--rollout.engine.device=cpu",
    "--rollout.engine.dtype=float32",
    "--rollout.engine.max_num_seqs=16",
    "--reward.max_batch_size=16",
    "--learner.ds.dtype=fp32",
    "--learner.ds.zero_stage=0",
    "--learner.ds.micro_batch_size=8",
    "--learner.ds.grad_accum=2",
    "--learner.weights_transport=zmq",
    "--learner.lora.rank=8",
    "--learner.lora.alpha=16",
    "--rollout.engine.max_lora_rank=8",
    "--learner.checkpoint_every=3",
    "--up.gpus={}",
    '--up.threads={"learner": 1, "rollout": 1, "reward": 1, "coordinator": 1}',
]
"""``--smoke``: the recipe at CPU size (the transformers engine and the learner on the CPU, float32)."""

CALL_OVERRIDES = [
    "--coordinator.prompts_per_step=8",
    "--coordinator.sampling.max_new_tokens=128",
    "--rollout.engine.max_model_len=160",
    "--rollout.engine.max_num_seqs=64",
    "--learner.ds.grad_accum=4",
]
"""``--size call`` (the default on a GPU): the recipe's work cut so that both sides fit one 10-minute
device call after the kit's install (8 prompts x 8 samples x 128 new tokens a step instead of 32 x 8 x 256;
micro-batch 16 x 4 accumulated = the 64 samples, one optimizer step; rank, targets, optimizer and the rest as
the recipe). ``--size recipe`` runs the recipe's own batch (then run the sides in two calls, ``--sides``,
and join them with ``--combine``)."""


# ---------------------------------------------------------------------------------------------- settings


def ours_settings(resolved: dict[str, Any], steps: int) -> dict[str, Any]:
    """streamrl's settings in the common vocabulary, from ``streamrl up --dry-run``'s JSON (pure)."""
    coordinator, rollout, learner = resolved["coordinator"], resolved["rollout"], resolved["learner"]
    ds, lora, algo, engine = learner["ds"], learner["lora"] or {}, learner["algo"], rollout["engine"]
    sampling = coordinator["sampling"]
    if engine["model"] != learner["model"]:
        raise ValueError(f"rollout.engine.model {engine['model']!r} is not learner.model {learner['model']!r}")
    vllm = engine["type"] == "vllm"
    targets = lora.get("target_modules")
    return {
        "model": str(Path(learner["model"]).resolve()),
        "device": "cpu" if engine.get("device") == "cpu" else "cuda",
        "dtype": {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}[ds["dtype"]],
        "lora_rank": lora.get("rank"),
        "lora_alpha": float(lora["alpha"]) if lora else None,
        "lora_dropout": lora.get("dropout"),
        "lora_target_modules": targets if isinstance(targets, str) or targets is None else sorted(targets),
        "prompts_per_step": coordinator["prompts_per_step"],
        "group_size": coordinator["group_size"],
        "max_new_tokens": sampling["max_new_tokens"],
        "max_model_len": engine["max_model_len"],
        "temperature": sampling["temperature"],
        "top_p": sampling["top_p"],
        "top_k": sampling["top_k"],
        "steps": steps,
        "seed": ds["seed"],
        "lr": ds["lr"],
        "scheduler": ds["scheduler"],
        "warmup_steps": ds["warmup_steps"],
        "optimizer": "adamw" if ds.get("torch_adam", True) else "deepspeed_adam",
        "betas": list(ds["betas"]),
        "eps": ds["eps"],
        "weight_decay": ds["weight_decay"],
        "grad_clip": ds["grad_clip"],
        "micro_batch_size": ds["micro_batch_size"],
        "grad_accum": ds["grad_accum"],
        "updates_per_step": learner["mini_batches"] * learner["ppo_epochs"],
        "gradient_checkpointing": ds["gradient_checkpointing"],
        "kl_coef": 0.0 if algo["kl"]["placement"] == "none" else algo["kl"]["coef"],
        "clip_eps_low": algo["loss"]["clip_eps_low"],
        "clip_eps_high": algo["loss"]["clip_eps_high"],
        "loss_aggregation": algo["loss"]["aggregation"],
        "advantage": algo["advantage"]["estimator"],
        "vllm": vllm,
        "gpu_memory_utilization": engine["gpu_memory_utilization"] if vllm else None,
        "max_num_seqs": engine["max_num_seqs"] if vllm else None,
        "checkpoint_every": learner["checkpoint_every"],
    }


def trl_input(ours: dict[str, Any], data_dir: str, output_dir: str) -> dict[str, Any]:
    """What the TRL script is given: streamrl's settings (TRL builds its configs from them and the
    harness reads them back), the data folder and TRL's output folder. TRL's vLLM needs a context
    length; without vLLM (the CPU smoke) there is none."""
    return {**ours, "data_dir": data_dir, "trl_output_dir": output_dir}


def same_value(a: Any, b: Any) -> bool:
    """Equal, numbers to a relative 1e-12 (a float read back from another config may round)."""
    numbers = all(isinstance(v, float | int) and not isinstance(v, bool) for v in (a, b))
    if numbers:
        return abs(a - b) <= 1e-12 * max(abs(a), abs(b), 1.0)
    return bool(a == b)


def parity_errors(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """One line per setting of :data:`PARITY_FIELDS` the two sides do not share (pure). Without vLLM the
    context length, memory share and decode batch are vLLM's alone and not compared."""
    skip = set() if ours.get("vllm") else {"max_model_len", "gpu_memory_utilization", "max_num_seqs"}
    errors = []
    for name in PARITY_FIELDS:
        if name in skip:
            continue
        a, b = ours.get(name), theirs.get(name)
        if a is None or b is None or not same_value(a, b):
            errors.append(f"{name}: streamrl {a!r} vs TRL {b!r}")
    return errors


def check_parity(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming every setting the two sides do not share."""
    errors = parity_errors(ours, theirs)
    if errors:
        raise ValueError("the two sides' settings differ, refusing to run: " + "; ".join(errors))


# ---------------------------------------------------------------------------------------------- timing


def our_step_ends(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> wall-clock end (s since the epoch) of streamrl's learner steps, from ``metrics.jsonl`` rows
    (the learner's rows carry ``learner/step_s``; pure)."""
    return {int(r["step"]): float(r["time"]) for r in rows if "learner/step_s" in r}


def trl_step_ends(events: list[dict[str, Any]]) -> tuple[dict[int, float], dict[int, float]]:
    """``(step -> end, step -> end of that step's saves)`` from the TRL callback's events (pure). A save
    at a step is its checkpoint; the ``saved`` event (``save_model`` after training) counts as a save
    of the last step."""
    ends = {int(e["step"]): float(e["time"]) for e in events if e["event"] == "step"}
    saves: dict[int, float] = {}
    for e in events:
        if e["event"] in ("save", "saved"):
            saves[int(e["step"])] = max(saves.get(int(e["step"]), 0.0), float(e["time"]))
    return ends, saves


def step_stats(
    ends: dict[int, float],
    launched: float,
    warmup: int,
    wall_step: int,
    min_measured: int,
    saves: dict[int, float] | None = None,
) -> dict[str, Any]:
    """Median step time over the steps after ``warmup`` and the wall time from ``launched`` to step
    ``wall_step`` done (its saves included), from step end times (pure).

    A step's duration is the gap between its end and the previous step's end, where the previous end
    includes that step's saves (TRL saves after the step's callback; streamrl's row comes after the
    save). ``enough`` says whether at least ``min_measured`` steps were measured."""
    saves = saves or {}
    done = {k: max(t, saves.get(k, t)) for k, t in ends.items()}
    durations = {k: ends[k] - done[k - 1] for k in sorted(ends) if k > warmup and k - 1 in done}
    median = statistics.median(durations.values()) if durations else None
    return {
        "steps_done": len(ends),
        "measured_steps": [min(durations), max(durations)] if durations else None,
        "num_measured": len(durations),
        "enough": len(durations) >= min_measured,
        "s_per_step_median": median,
        "s_per_step_mean": statistics.fmean(durations.values()) if durations else None,
        "step_s": {str(k): round(v, 4) for k, v in durations.items()},
        "launch_to_first_step_s": min(ends.values()) - launched if ends else None,
        f"wall_to_step_{wall_step}_s": done[wall_step] - launched if wall_step in done else None,
    }


def ratios(ours: dict[str, Any], theirs: dict[str, Any], wall_step: int) -> dict[str, float | None]:
    """TRL over streamrl: per-step median and wall time to ``wall_step`` (pure; None where one is missing)."""
    key = f"wall_to_step_{wall_step}_s"

    def over(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    return {
        "per_step_ratio": over(theirs.get("s_per_step_median"), ours.get("s_per_step_median")),
        "wall_ratio": over(theirs.get(key), ours.get(key)),
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# ---------------------------------------------------------------------------------------------- runs


def run_data_overrides(data_dir: Path, model: str | Path) -> list[str]:
    """Our side's overrides that point the recipe at the prepared data and model (no evaluation set)."""
    return [
        f"--coordinator.dataset.path={data_dir}/train.jsonl",
        f"--coordinator.dataset.tokenizer={model}",
        "--coordinator.eval.dataset=null",
        f"--rollout.engine.model={model}",
        f"--learner.model={model}",
    ]


LAUNCHER_VARS = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
"""A distributed launcher's variables, left out of both sides' environment: each side is started as a user
starts it, alone (inherited from a process that ran a torch.distributed job, accelerate's TRL would try to
join a group that does not exist)."""


def child_env(device: str, cache_dir: Path | None = None) -> dict[str, str]:
    """Both sides' environment: local files only; on the CPU smoke one thread per process. With
    ``cache_dir``, vLLM's, inductor's and Triton's compile caches start empty there: each side pays its
    own compile (the two would otherwise share what the first one compiled)."""
    env = {
        **{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS},
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    if device == "cpu":
        env.update(OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if cache_dir is not None:
        env.update(
            VLLM_CACHE_ROOT=str(cache_dir / "vllm"),
            TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"),
            TRITON_CACHE_DIR=str(cache_dir / "triton"),
        )
    return env


def wait(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, bool]:
    """``(exit code, timed out)``; at the limit SIGINT (both sides stop cleanly on it), then kill."""
    try:
        return proc.wait(timeout_s), False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(30), True
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(), True


def prepare(recipe: str, preset: str, data_dir: Path, device: str) -> dict[str, Any]:
    """Data and the random policy through ``examples/arithmetic/prepare.py`` (nothing redone if there)."""
    started = time.perf_counter()
    cmd = [
        sys.executable,
        str(ROOT / "examples/arithmetic/prepare.py"),
        recipe,
        f"--prepare.preset={preset}",
        f"--prepare.out_dir={data_dir}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(device), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"prepare failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "prepare_s": round(time.perf_counter() - started, 1)}


def our_command(recipe: str, overrides: list[str]) -> list[str]:
    """``streamrl up RECIPE OVERRIDES`` (the launcher's module: the ``streamrl`` command runs it)."""
    return [sys.executable, "-m", "streamrl.ops.cli", "up", recipe, *overrides]


def dry_run_ours(recipe: str, overrides: list[str], device: str) -> dict[str, Any]:
    """``streamrl up --dry-run``: every service's resolved config, nothing started."""
    proc = subprocess.run(
        [*our_command(recipe, overrides), "--dry-run"], cwd=ROOT, env=child_env(device), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"streamrl up --dry-run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout))


def dry_run_trl(settings_file: Path, device: str) -> dict[str, Any]:
    """The TRL script's ``--dry-run``: the settings read back from the configs it builds."""
    cmd = [sys.executable, str(TRL_SCRIPT), "--settings", str(settings_file), "--dry-run"]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(device), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the TRL script's --dry-run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def run_side(name: str, cmd: list[str], log_path: Path, timeout_s: float, device: str) -> dict[str, Any]:
    """Launch one side, wait for it (or its limit), with peak GPU memory; the launch time is its clock's zero."""
    from gpu_pipeline import GpuMemory

    print(f"gpu_vs_trl_7b: {name}: {shlex.join(cmd)}", flush=True)
    with GpuMemory() as memory, log_path.open("w") as log:
        launched = time.time()
        env = child_env(device, log_path.parent / f"cache-{name}")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        code, timed_out = wait(proc, timeout_s)
        finished = time.time()
    peak = memory.summary()
    return {
        "command": shlex.join(cmd),
        "launched": launched,
        "exit_code": code,
        "timed_out": timed_out,
        "launch_to_exit_s": round(finished - launched, 1),
        "peak_gpu_gib": round(max(peak["peak_mib"].values()) / 1024, 2) if peak and peak["peak_mib"] else None,
        "gpu_memory": peak,
        "log": str(log_path),
    }


def summarize_ours(side: dict[str, Any], run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """streamrl's step statistics, plus the pipeline summary of ``bench/gpu_pipeline.py`` (generated
    tokens/s, weight-sync times) over its own window."""
    from gpu_pipeline import summarize_streamrl

    rows = read_jsonl(run_dir / "metrics.jsonl")
    stats = step_stats(our_step_ends(rows), side["launched"], args.warmup_steps, args.wall_step, args.min_measured)
    log = Path(side["log"]).read_text(errors="replace")
    detail = summarize_streamrl(rows, log, args.steps) if rows else {}
    detail.pop("first_step_at", None)
    return {**side, **stats, "generated_tokens_per_s": detail.get("generated_tokens_per_s"), "pipeline": detail}


def summarize_trl(side: dict[str, Any], events_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """TRL's step statistics and generated tokens/s over the measured steps, from its callback's events."""
    events = read_jsonl(events_path)
    ends, saves = trl_step_ends(events)
    stats = step_stats(ends, side["launched"], args.warmup_steps, args.wall_step, args.min_measured, saves)
    tokens = {int(e["step"]): e["generated_tokens"] for e in events if e["event"] == "step"}
    measured = stats["measured_steps"]
    rate = None
    if measured and measured[0] - 1 in tokens and measured[1] in tokens:
        span = ends[measured[1]] - ends[measured[0] - 1]
        rate = (tokens[measured[1]] - tokens[measured[0] - 1]) / span if span > 0 else None
    return {**side, **stats, "generated_tokens_per_s": rate, "events": str(events_path)}


def combine(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from reports of one side each, run on the same machine with the same settings (refused
    otherwise, naming what differs): the sides of a run split over two device calls (pure)."""
    first = reports[0]
    for other in reports[1:]:
        check_parity(first["settings"]["streamrl"], other["settings"]["streamrl"])
        if other["machine"].get("gpus") != first["machine"].get("gpus"):
            raise ValueError(f"not the same GPUs: {first['machine'].get('gpus')} vs {other['machine'].get('gpus')}")
    out = {**first, "combined_from": [r["date"] for r in reports], "errors": []}
    for side in ("streamrl", "trl"):
        out[side] = next((r[side] for r in reports if r.get(side)), None)
    for r in reports:
        out["errors"] += r.get("errors", [])
    if out["streamrl"] and out["trl"]:
        wall = next(int(k.split("_")[3]) for k in out["streamrl"] if k.startswith("wall_to_step_"))
        out.update(ratios(out["streamrl"], out["trl"], wall))
    return out


# ---------------------------------------------------------------------------------------------- main


def package_versions() -> dict[str, str | None]:
    """Versions of what the two sides run on, from the installed metadata (nothing imported)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for package in ("torch", "transformers", "trl", "peft", "vllm", "deepspeed", "accelerate"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--smoke", action="store_true", help="the whole harness on the CPU with a tiny Qwen2")
    parser.add_argument("--recipe", default=str(RECIPE), help="streamrl's recipe (default recipes/gpu_7b_lora.toml)")
    parser.add_argument("--model", default=None, help="a policy folder to use instead of preparing the random one")
    parser.add_argument(
        "--size",
        choices=["call", "recipe"],
        default="call",
        help="GPU work per step: fit one device call, or the recipe's",
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per side (default 30; 8 with --smoke)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps left out of the median (5; 2 smoke)")
    parser.add_argument("--wall-step", type=int, default=None, help="launch to this step's end (default --steps)")
    parser.add_argument("--min-measured", type=int, default=None, help="steps the median needs (20; 3 smoke)")
    parser.add_argument("--sides", default="streamrl,trl", help="which sides run, in this order")
    parser.add_argument("--timeout-s", type=float, default=None, help="limit per side (default 240; 420 smoke)")
    parser.add_argument(
        "--override", action="append", default=[], metavar="--SECTION.FIELD=VALUE", help="one more recipe override"
    )
    parser.add_argument("--out", default=None, help="report folder (default $OUT, else bench/results)")
    parser.add_argument(
        "--combine", nargs="+", default=None, metavar="REPORT", help="join reports of one side each; run nothing"
    )
    parser.add_argument(
        "--check-only", action="store_true", help="prepare, read both sides' settings and compare them; run nothing"
    )
    args = parser.parse_args(argv)
    args.steps = args.steps or (8 if args.smoke else 30)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (2 if args.smoke else 5)
    args.wall_step = args.wall_step or args.steps
    args.min_measured = args.min_measured if args.min_measured is not None else (3 if args.smoke else 20)
    args.timeout_s = args.timeout_s or (420.0 if args.smoke else 240.0)
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not args.sides or set(args.sides) - {"streamrl", "trl"}:
        parser.error(f"--sides: streamrl and/or trl, got {args.sides}")
    if args.wall_step > args.steps or args.steps - args.warmup_steps < args.min_measured:
        parser.error("--steps must leave --min-measured steps after --warmup-steps and reach --wall-step")
    args.out = str(Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results").resolve())
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from gpu import machine_facts

    if args.combine:
        joined = combine([json.loads(Path(p).read_text()) for p in args.combine])
        joined["command"] = shlex.join(["python", "bench/gpu_vs_trl_7b.py", *argv])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"gpu_vs_trl_7b-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.json"
        path.write_text(json.dumps(joined, indent=2))
        print(json.dumps(joined), flush=True)
        return 1 if joined["errors"] else 0
    device = "cpu" if args.smoke else "cuda"
    started = datetime.now(timezone.utc)
    work = ROOT / "runs" / ("gpu_vs_trl_smoke" if args.smoke else "gpu_vs_trl_7b")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    report: dict[str, Any] = {
        "bench": "gpu_vs_trl_7b_smoke_cpu" if args.smoke else "gpu_vs_trl_7b",
        "note": "CPU smoke of the harness (tiny model, no vLLM): not a GPU figure" if args.smoke else None,
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join(["python", "bench/gpu_vs_trl_7b.py", *argv]),
        "machine": machine_facts(),
        "design_differences": DESIGN_DIFFERENCES,
        "versions": package_versions(),
        "streamrl": None,
        "trl": None,
        "errors": [],
    }

    if args.model:
        data_dir = work / "data"
        prepared = prepare(args.recipe, "qwen2_tiny", data_dir, device)  # the prompts; the model is --model's
        model = str(Path(args.model).resolve())
    else:
        preset = "qwen2_tiny" if args.smoke else "qwen2.5_7b"
        data_dir = ROOT / "runs" / ("gpu_vs_trl_tiny_data" if args.smoke else "gpu_7b_data")
        prepared = prepare(args.recipe, preset, data_dir, device)
        model = str(data_dir / "model")
    report["prepared"] = prepared
    print(f"gpu_vs_trl_7b: prepared {json.dumps(prepared)}", flush=True)

    overrides = [
        *(SMOKE_OVERRIDES if args.smoke else CALL_OVERRIDES if args.size == "call" else []),
        *args.override,
        f"--total_steps={args.steps}",
        *run_data_overrides(data_dir, model),
        f"--run_dir={work / 'streamrl'}",
        f"--run_id=gpu-vs-trl-{int(time.time())}",
    ]
    ours = ours_settings(dry_run_ours(args.recipe, overrides, device), args.steps)
    settings_file = work / "trl_settings.json"
    settings_file.write_text(json.dumps(trl_input(ours, str(data_dir), str(work / "trl")), indent=2))
    theirs = dry_run_trl(settings_file, device)
    report["settings"] = {"streamrl": ours, "trl": theirs, "streamrl_overrides": overrides}
    check_parity(ours, theirs)  # refuses before either side starts
    if args.check_only:
        print(json.dumps({"parity": "same", **report["settings"]}), flush=True)
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_vs_trl_7b_smoke-cpu" if args.smoke else "gpu_vs_trl_7b"
    path = out / f"{stem}-{started:%Y%m%d-%H%M%S}.json"

    def save() -> None:
        """The report as it stands, and each side's log beside it: a device call cut short keeps them."""
        report["seconds"] = round((datetime.now(timezone.utc) - started).total_seconds(), 1)
        path.write_text(json.dumps(report, indent=2))
        for side_name in args.sides:
            source = work / f"{side_name}.log"
            if source.exists() and out != ROOT / "bench" / "results":
                shutil.copy(source, out / f"{stem}-{side_name}.log")

    save()
    sides: dict[str, dict[str, Any]] = {}
    for name in args.sides:
        if name == "streamrl":
            side = run_side(name, our_command(args.recipe, overrides), work / "streamrl.log", args.timeout_s, device)
            sides[name] = summarize_ours(side, work / "streamrl", args)
        else:
            events = work / "trl_events.jsonl"
            cmd = [sys.executable, str(TRL_SCRIPT), "--settings", str(settings_file), "--events", str(events)]
            side = run_side(name, cmd, work / "trl.log", args.timeout_s, device)
            sides[name] = summarize_trl(side, events, args)
        report[name] = sides[name]
        brief = {k: v for k, v in sides[name].items() if k not in ("step_s", "pipeline", "gpu_memory")}
        print(f"gpu_vs_trl_7b: {name} {json.dumps(brief)}", flush=True)
        save()
    if "streamrl" in sides and "trl" in sides:
        report.update(ratios(sides["streamrl"], sides["trl"], args.wall_step))
    report["errors"] = [
        f"{name}: exit code {s['exit_code']}{', timed out' if s['timed_out'] else ''}"
        + ("" if s["enough"] else f", {s['num_measured']} steps measured (< {args.min_measured})")
        for name, s in sides.items()
        if s["exit_code"] != 0 or s["timed_out"] or not s["enough"]
    ]
    save()
    print(f"gpu_vs_trl_7b: report written to {path}", flush=True)
    print(json.dumps(report), flush=True)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
