"""Benchmark: tokens/s of the RL learner's training step (``RLTrainer.step``) on a random 0.5B Qwen2.

The trainer is built from a ``LearnerConfig`` for the same random model as bench/sft_gpu.py (bf16,
ZeRO-2) and timed on random ``TrainingBatch``-es: ``--groups`` x ``--group-size`` samples (default
64 x 8), prompts of ``--prompt-len`` tokens (one per group), responses of ``--response-len`` tokens
(``--random-lengths``: uniform in 1..response-len), sampled at temperature ``--temperature``. The
default algorithm (GRPO-style, one update per batch, no KL, no critic) makes one policy
forward/backward per micro-batch (``--grad-accum`` micro-batches per step) and one optimizer step.

Reported: tokens/s counting prompt + response tokens (what the forward processes), response
tokens/s, and an MFU estimate with bench/sft_gpu.py's formula (6 N tokens + causal attention per
sample; the fused head's recompute in the backward pass is not counted).

Run (one GPU):   python bench/rl_step_gpu.py
CPU smoke test:  python bench/rl_step_gpu.py --tiny
Ablation:        python bench/rl_step_gpu.py --variants '[{"label": "levers off", "attn": "sdpa", "head": "full",
                 "kernels": "none", "fused_optimizer": false}, {"label": "default"}]'
The last line printed is one JSON object, also written to ``--out-dir`` as rl_step_gpu-<date>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for src in ("libs/common/src", "services/learner/src", "bench"):
    if str(REPO / src) not in sys.path:
        sys.path.insert(0, str(REPO / src))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sft_gpu import FULL, PEAK_FLOPS, TINY, build_random_model  # noqa: E402

from streamrl.common.messages import SamplingParams, ScoredTrajectory, Tensor, TrainingBatch, Trajectory  # noqa: E402
from streamrl.learner.ds_config import DeepSpeedConfig  # noqa: E402
from streamrl.learner.engine import init_distributed  # noqa: E402
from streamrl.learner.rl.config import LearnerConfig  # noqa: E402
from streamrl.learner.rl.trainer import RLTrainer  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model, fp32, ZeRO-0, short sequences: a CPU smoke test")
    p.add_argument("--steps", type=int, default=3, help="timed training steps (batches)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--random-lengths", action="store_true", help="response lengths uniform in 1..response-len")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--grad-accum", type=int, default=16, help="micro-batches per step")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--attn", default="varlen", choices=["varlen", "sdpa", "flash_attention_2", "eager"])
    p.add_argument("--head", default="fused", choices=["fused", "full"])
    p.add_argument("--head-chunk", type=int, default=8192)
    p.add_argument("--kernels", default="auto", choices=["auto", "liger", "none"])
    p.add_argument("--no-fused-optimizer", dest="fused_optimizer", action="store_false")
    p.add_argument("--entropy-coef", type=float, default=0.0, help="> 0: the entropy bonus (entropy computed too)")
    p.add_argument("--share-prompts", action="store_true", help="learner.share_prompts (the padded KV-cache path)")
    p.add_argument("--variants", default="", help="JSON list of dicts overriding the options above (+ a 'label')")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    return p.parse_args()


def random_batch(args: argparse.Namespace, vocab: int, index: int) -> TrainingBatch:
    """``groups`` x ``group_size`` random samples: one random prompt per group, random responses."""
    rng = np.random.default_rng(index)
    samples = []
    for g in range(args.groups):
        prompt = rng.integers(0, vocab, size=args.prompt_len).astype(np.int32)
        for j in range(args.group_size):
            n = int(rng.integers(1, args.response_len + 1)) if args.random_lengths else args.response_len
            traj = Trajectory(
                id=f"b{index}/p{g}/{j}",
                group_id=f"b{index}/p{g}",
                group_index=j,
                group_size=args.group_size,
                prompt_ids=Tensor.from_numpy(prompt),
                response_ids=Tensor.from_numpy(rng.integers(0, vocab, size=n).astype(np.int32)),
                logprobs=Tensor.from_numpy(rng.uniform(-3.0, -0.1, size=n).astype(np.float32)),
                loss_mask=Tensor.from_numpy(np.ones(n, dtype=np.uint8)),
                sampling=SamplingParams(temperature=args.temperature),
            )
            samples.append(ScoredTrajectory(trajectory=traj, reward=float(rng.integers(0, 2))))
    return TrainingBatch(
        id=f"bench-{index}", index=index, samples=samples, policy_version=0, staleness=[0] * len(samples)
    )


def run_variant(args: argparse.Namespace, shape: dict[str, int], dtype: str, model_dir: Path) -> dict[str, Any]:
    ds = DeepSpeedConfig(
        zero_stage=args.zero_stage,
        dtype=dtype,
        lr=1e-6,
        scheduler="constant",
        grad_accum=args.grad_accum,
        attn_implementation=args.attn,
        logprob_head=args.head,
        head_chunk_tokens=args.head_chunk,
        kernels=args.kernels,
        fused_optimizer=args.fused_optimizer,
    )
    cfg = LearnerConfig.model_validate(
        {
            "model": str(model_dir),
            "ds": ds.model_dump(),
            "total_steps": args.warmup + args.steps,
            "share_prompts": args.share_prompts,
            "algo": {"loss": {"entropy_coef": args.entropy_coef}},
        }
    )
    trainer = RLTrainer(cfg)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.policy.module.parameters())
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    tokens = responses = 0
    flops = 0.0
    start = 0.0
    metrics: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        batch = random_batch(args, shape["vocab_size"], step)
        if step == args.warmup:
            sync()
            start = time.perf_counter()
            tokens = responses = 0
            flops = 0.0
        metrics = trainer.step(batch)
        for s in batch.samples:
            length = len(s.trajectory.prompt_ids.to_numpy()) + len(s.trajectory.response_ids.to_numpy())
            tokens += length
            responses += len(s.trajectory.response_ids.to_numpy())
            flops += 6.0 * n_params * length + 6.0 * shape["num_hidden_layers"] * shape["hidden_size"] * length**2
    sync()
    elapsed = time.perf_counter() - start
    result = {
        "label": getattr(args, "label", ""),
        "params": n_params,
        "dtype": dtype,
        "zero_stage": args.zero_stage,
        "attn": args.attn,
        "head": args.head,
        "kernels": args.kernels,
        "fused_optimizer": args.fused_optimizer,
        "share_prompts": args.share_prompts,
        "entropy_coef": args.entropy_coef,
        "samples_per_step": args.groups * args.group_size,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "random_lengths": args.random_lengths,
        "grad_accum": args.grad_accum,
        "timed_steps": args.steps,
        "seconds_per_step": elapsed / args.steps,
        "tokens_per_s": tokens / elapsed,
        "response_tokens_per_s": responses / elapsed,
        "mfu": flops / elapsed / PEAK_FLOPS,
        "last_loss": metrics.get("learner/loss/policy", float("nan")),
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }
    return result


def main() -> int:
    args = parse_args()
    if args.tiny:
        args.groups, args.group_size, args.prompt_len, args.response_len = 4, 4, 12, 20
        args.grad_accum, args.steps, args.zero_stage = 2, min(args.steps, 2), 0
    shape = TINY if args.tiny else FULL
    dtype = "fp32" if args.tiny else "bf16"
    init_distributed()
    if torch.distributed.get_world_size() != 1:
        raise SystemExit("rl_step_gpu.py times one learner process; run it without torchrun")
    model_dir = build_random_model(shape, dtype, args.prompt_len + args.response_len, 0)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {
        "bench": "rl_step_gpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{device}, {platform.node()}, torch {torch.__version__}",
        "command": " ".join(["python", *sys.argv]),
        "tiny": args.tiny,
        "results": [],
    }
    path = Path(args.out_dir) / f"rl_step_gpu{'_tiny' if args.tiny else ''}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for overrides in json.loads(args.variants) if args.variants else [{}]:
        result = run_variant(argparse.Namespace(**{**vars(args), **overrides}), shape, dtype, model_dir)
        gc.collect()  # the variant's trainer, before the next one is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        report["results"].append(result)
        path.write_text(json.dumps(report, indent=2))  # after every variant: a cut-off run keeps what it measured
        print(
            f"{result['label'] or 'run':>14}: {result['seconds_per_step']:.2f} s/step  tokens/s {result['tokens_per_s']:.0f}"
            f"  response tokens/s {result['response_tokens_per_s']:.0f}  MFU {100 * result['mfu']:.1f}%"
            f"  loss {result['last_loss']:.4f}  max mem {result['max_memory_gib'] or 0:.1f} GiB",
            flush=True,
        )
    shutil.rmtree(model_dir.parent, ignore_errors=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
