"""Benchmark: SFT throughput and MFU of the learner's DeepSpeed engine on a random 0.5B Qwen2.

Model: Qwen2 architecture with vocab 151,669, hidden 896, 24 layers, 14 heads (2 KV heads),
intermediate 4864, tied embeddings, randomly initialised (saved to a temp folder and loaded
through ``ModelEngine.from_config``, the path the jobs use). bf16, ZeRO-2, packed rows of 2048
tokens (random sample lengths, best-fit packing, per-sample attention; 16 rows per micro-batch, 2
micro-batches per optimizer step: 65,536 tokens a step), loss through the SFT
job's own code (``SFTTask.train_loss``: one flat varlen forward per micro-batch, fused log-prob
head; :mod:`streamrl.learner.lm_forward`).

FLOPs per optimizer step (forward + backward = 3 x forward)::

    6 * N * tokens  +  6 * n_layers * hidden * sum_i(s_i^2)

with N = parameter count (tied embedding counted once, as the output head's matmul) and the
second term the causal attention score/value matmuls of every packed sample of length s_i
(12 * L * h * s^2 for full attention, halved for the causal mask). Padding tokens count in
``tokens`` for throughput but not in the attention term. MFU = achieved FLOP/s divided by
989e12 x GPUs: NVIDIA's dense bf16 peak for one H100/H200 SXM (no sparsity).
``mfu_executed`` counts the output head only at the positions the job computes it for (those with a
target: the fused head skips prompt and padding positions); ``mfu`` counts it at every token.

Levers (each a DeepSpeedConfig field, defaults = the product's): ``--attn``, ``--head``,
``--kernels``, ``--no-fused-optimizer``, ``--check-overflow``, ``--compile``; ``--variants`` runs several settings in one process
(one model build) and ``--profile`` writes a torch.profiler table of a few steps of each.

Run (one GPU):   python bench/sft_gpu.py
Several GPUs:    torchrun --nproc_per_node 2 bench/sft_gpu.py
CPU smoke test:  python bench/sft_gpu.py --tiny
Ablation:        python bench/sft_gpu.py --variants '[{"label": "sdpa", "attn": "sdpa"}, {"label": "default"}]'
The last line printed is one JSON object (a list with --variants), also written to
``--out-dir`` (bench/results/) as sft_gpu-<date>.json.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for src in ("libs/common/src", "services/learner/src"):
    if str(REPO / src) not in sys.path:
        sys.path.insert(0, str(REPO / src))

import torch  # noqa: E402

from streamrl.learner.ds_config import DeepSpeedConfig  # noqa: E402
from streamrl.learner.engine import ModelEngine, init_distributed  # noqa: E402
from streamrl.learner.logprobs import IGNORE_INDEX  # noqa: E402
from streamrl.learner.offline.sft import SFTTask  # noqa: E402
from streamrl.learner.packing import Sample, pack_samples  # noqa: E402

PEAK_FLOPS = 989e12  # H200 (= H100 SXM) dense bf16 tensor-core peak, per GPU
FULL = {
    "vocab_size": 151_669,
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
}
TINY = {
    "vocab_size": 259,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model, fp32, ZeRO-0, short rows: a CPU smoke test")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    p.add_argument("--micro-batch", type=int, default=16, help="packed rows per micro-batch per GPU")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=2048, help="packed row length")
    p.add_argument("--min-sample", type=int, default=128, help="shortest random sample (tokens)")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--attn", default="varlen", choices=["varlen", "sdpa", "flash_attention_2", "eager"])
    p.add_argument(
        "--head", default="fused", choices=["fused", "full"], help="log-prob head (DeepSpeedConfig.logprob_head)"
    )
    p.add_argument("--head-chunk", type=int, default=8192, help="tokens per chunk of the fused head")
    p.add_argument("--kernels", default="auto", choices=["auto", "liger", "none"], help="fused RMSNorm/SwiGLU/RoPE")
    p.add_argument("--no-fused-optimizer", dest="fused_optimizer", action="store_false", help="torch AdamW foreach")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder (DeepSpeedConfig.compile)")
    p.add_argument("--check-overflow", dest="skip_nonfinite_steps", action="store_true", help="skip_nonfinite_steps")
    p.add_argument("--fused-adam", action="store_true", help="DeepSpeed FusedAdam instead of torch AdamW")
    p.add_argument("--variants", default="", help="JSON list of dicts overriding the options above (+ a 'label')")
    p.add_argument("--profile", type=int, default=0, help="profile this many steps after the timed ones (table file)")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"), help="where the result JSON goes")
    return p.parse_args()


def random_samples(n_tokens: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[Sample]:
    """Random token samples (first quarter of each = prompt, masked) totalling about ``n_tokens``."""
    rng = random.Random(seed)
    samples, total = [], 0
    while total < n_tokens:
        n = rng.randint(min_len, max_len)
        ids = [rng.randrange(vocab) for _ in range(n)]
        cut = n // 4
        samples.append(Sample(ids, [IGNORE_INDEX] * cut + ids[cut:]))
        total += n
    return samples


def build_random_model(shape: dict[str, int], dtype: str, seq_len: int, rank: int) -> Path:
    """Rank 0 saves a random Qwen2 (+ a byte-level tokenizer, only needed for export) and shares its folder."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

    folder = [""]
    if rank == 0:
        model_dir = Path(tempfile.mkdtemp(prefix="streamrl_bench_")) / "model"
        torch.manual_seed(0)
        config = Qwen2Config(**shape, max_position_embeddings=max(4096, seq_len), tie_word_embeddings=True)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
        model.save_pretrained(model_dir)
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
        Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>").save_pretrained(model_dir)
        folder = [str(model_dir)]
    torch.distributed.broadcast_object_list(folder, src=0)
    return Path(folder[0])


def attention_flops(position_ids: torch.Tensor, n_layers: int, hidden: int) -> float:
    """Causal attention matmul FLOPs (fwd + bwd) of packed rows, from their position-id restarts."""
    flops = 0.0
    for row in position_ids.tolist():
        starts = [i for i, p in enumerate(row) if p == 0] + [len(row)]
        for a, b in itertools.pairwise(starts):
            flops += 6.0 * n_layers * hidden * (b - a) ** 2
    return flops


def profile_table(run_step: Any, steps: int, path: Path) -> dict[str, float]:
    """Profile ``steps`` calls of ``run_step`` (CUDA kernels + CPU ops); write the tables; return ms per
    step by kernel family (matmul, attention, head, optimizer, elementwise/other)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    by_gpu = events.table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=90)
    by_cpu = events.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=90)
    path.write_text(f"{steps} steps\n\n== by GPU time ==\n{by_gpu}\n\n== by CPU time ==\n{by_cpu}\n")
    families = {"matmul": 0.0, "attention": 0.0, "head": 0.0, "optimizer": 0.0, "other": 0.0}
    for e in events:
        us = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        if not us or e.device_type.name != "CUDA":
            continue
        name = e.key.lower()
        if "flash" in name or "fmha" in name:  # before matmul: flash kernels' names hold cutlass types
            family = "attention"
        elif any(k in name for k in ("gemm", "nvjet", "cutlass", "sm90_xmma")):
            family = "matmul"
        elif "_stats_kernel" in name or "_grad_kernel" in name:
            family = "head"
        elif "adam" in name or "multi_tensor" in name:
            family = "optimizer"
        else:
            family = "other"
        families[family] += us / 1000 / steps
    return families


def run_variant(args: argparse.Namespace, shape: dict[str, int], dtype: str, model_dir: Path) -> dict[str, Any]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = DeepSpeedConfig(
        zero_stage=args.zero_stage,
        dtype=dtype,
        lr=1e-5,
        scheduler="constant",
        micro_batch_size=args.micro_batch,
        grad_accum=args.grad_accum,
        gradient_checkpointing=args.grad_ckpt,
        torch_adam=not args.fused_adam,
        attn_implementation=args.attn,
        logprob_head=args.head,
        head_chunk_tokens=args.head_chunk,
        kernels=args.kernels,
        fused_optimizer=args.fused_optimizer,
        skip_nonfinite_steps=args.skip_nonfinite_steps,
        compile=args.compile,
    )
    engine = ModelEngine.from_config(str(model_dir), cfg)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    per_step_rows = args.micro_batch * args.grad_accum
    total_steps = args.warmup + args.steps + (1 if args.profile else 0)
    samples = random_samples(
        int(per_step_rows * total_steps * args.seq_len * 1.02),
        shape["vocab_size"],
        args.min_sample,
        args.seq_len,
        1 + rank,
    )
    rows = pack_samples(samples, args.seq_len, pad_id=0)
    while len(rows) < per_step_rows * total_steps:
        rows += rows
    task = SFTTask(cfg)
    device = engine.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    head_flops_per_token = 6.0 * shape["hidden_size"] * shape["vocab_size"]
    # what each row counts, worked out before the clock runs (no host work in the timed loop)
    row_tokens = [len(r.input_ids) for r in rows]
    row_targets = [sum(t != IGNORE_INDEX for t in r.targets) for r in rows]
    row_flops = [
        6.0 * n_params * len(r.input_ids)
        + attention_flops(torch.tensor([r.position_ids]), shape["num_hidden_layers"], shape["hidden_size"])
        for r in rows
    ]
    counts = {"tokens": 0, "targets": 0, "flops": 0.0}
    losses: list[torch.Tensor] = []

    def run_step(engine: ModelEngine, step: int) -> None:
        first = step * per_step_rows
        step_rows = rows[first : first + per_step_rows]
        for m in range(args.grad_accum):
            micro = step_rows[m * args.micro_batch : (m + 1) * args.micro_batch]
            out, _ = task.train_loss(engine, micro)
            engine.backward(out)
            engine.step()
            losses.append(out.detach())  # read after the clock stops: a float() here would wait for the GPU
        picked = range(first, first + per_step_rows)
        counts["tokens"] += sum(row_tokens[i] for i in picked)
        counts["targets"] += sum(row_targets[i] for i in picked)
        counts["flops"] += sum(row_flops[i] for i in picked)

    start = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            torch.distributed.barrier()
            start = time.perf_counter()
            counts.update(tokens=0, targets=0, flops=0.0)
        run_step(engine, step)
    sync()
    elapsed = time.perf_counter() - start
    totals = torch.tensor([counts["tokens"], counts["targets"], counts["flops"]], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(totals)
    tokens_all, targets_all, flops_all = totals.tolist()
    flops_executed = flops_all - head_flops_per_token * (tokens_all - targets_all)
    result = {
        "label": getattr(args, "label", ""),
        "world_size": world,
        "params": n_params,
        "dtype": dtype,
        "zero_stage": args.zero_stage,
        "attn": args.attn,
        "head": args.head,
        "head_chunk": args.head_chunk,
        "kernels": args.kernels,
        "fused_optimizer": args.fused_optimizer,
        "skip_nonfinite_steps": args.skip_nonfinite_steps,
        "compile": args.compile,
        "grad_ckpt": args.grad_ckpt,
        "optimizer": "DeepSpeed FusedAdam" if args.fused_adam else "torch AdamW",
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "timed_steps": args.steps,
        "seconds": elapsed,
        "tokens_per_s": tokens_all / elapsed,
        "tokens_per_s_per_gpu": tokens_all / elapsed / world,
        "target_fraction": targets_all / tokens_all,
        "tflops_per_gpu": flops_all / elapsed / world / 1e12,
        "mfu": flops_all / elapsed / (PEAK_FLOPS * world),
        "mfu_executed": flops_executed / elapsed / (PEAK_FLOPS * world),
        "peak_flops_per_gpu": PEAK_FLOPS,
        "last_loss": float(losses[-1]),
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    if args.profile and device.type == "cuda" and rank == 0:
        name = f"sft_gpu_profile-{result['label'] or 'run'}-{time.strftime('%Y%m%d')}.txt"
        step = args.warmup + args.steps
        result["profile_ms_per_step"] = profile_table(
            lambda: run_step(engine, step), args.profile, Path(args.out_dir) / name
        )
        result["profile_file"] = name
    return result


def main() -> int:
    args = parse_args()
    if args.tiny:
        args.seq_len, args.min_sample, args.micro_batch = min(args.seq_len, 128), 8, 2
        args.steps, args.warmup, args.zero_stage = min(args.steps, 3), 1, 0
    shape = TINY if args.tiny else FULL
    dtype = "fp32" if args.tiny else "bf16"
    init_distributed()
    rank = torch.distributed.get_rank()
    model_dir = build_random_model(shape, dtype, args.seq_len, rank)
    variants = json.loads(args.variants) if args.variants else [{}]
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {
        "bench": "sft_gpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{device}, {platform.node()}, torch {torch.__version__}",
        "command": " ".join(["python", *sys.argv]),
        "tiny": args.tiny,
        "results": [],
    }
    path = Path(args.out_dir) / f"sft_gpu{'_tiny' if args.tiny else ''}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for overrides in variants:
        result = run_variant(argparse.Namespace(**{**vars(args), **overrides}), shape, dtype, model_dir)
        gc.collect()  # the variant's engine, before the next one is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if rank == 0:
            report["results"].append(result)
            path.write_text(json.dumps(report, indent=2))  # after every variant: a cut-off run keeps what it measured
            print(
                f"{result['label'] or 'run':>14}: tokens/s {result['tokens_per_s']:.0f}  MFU {100 * result['mfu']:.1f}%"
                f"  (executed {100 * result['mfu_executed']:.1f}%)  loss {result['last_loss']:.4f}"
                f"  max mem {result['max_memory_gib'] or 0:.1f} GiB",
                flush=True,
            )
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(model_dir.parent, ignore_errors=True)
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
