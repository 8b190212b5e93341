"""Benchmark: SFT throughput and MFU of the learner's DeepSpeed engine on a random 0.5B Qwen2.

Model: Qwen2 architecture with vocab 151,669, hidden 896, 24 layers, 14 heads (2 KV heads),
intermediate 4864, tied embeddings, randomly initialised (saved to a temp folder and loaded
through ``ModelEngine.from_config``, the path the jobs use). bf16, ZeRO-2, packed rows of 2048
tokens (random sample lengths, best-fit packing, per-sample attention), loss through the SFT
job's own code (``SFTTask.train_loss``).

FLOPs per optimizer step (forward + backward = 3 x forward)::

    6 * N * tokens  +  6 * n_layers * hidden * sum_i(s_i^2)

with N = parameter count (tied embedding counted once, as the output head's matmul) and the
second term the causal attention score/value matmuls of every packed sample of length s_i
(12 * L * h * s^2 for full attention, halved for the causal mask). Padding tokens count in
``tokens`` for throughput but not in the attention term. MFU = achieved FLOP/s divided by
989e12 x GPUs: NVIDIA's dense bf16 peak for one H100/H200 SXM (no sparsity).

Run (one GPU):   python bench/sft_gpu.py
Several GPUs:    torchrun --nproc_per_node 2 bench/sft_gpu.py
CPU smoke test:  python bench/sft_gpu.py --tiny
The last line printed is one JSON object, also written to bench/results/.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for src in ("libs/common/src", "services/learner/src"):
    if str(REPO / src) not in sys.path:
        sys.path.insert(0, str(REPO / src))

import torch  # noqa: E402

from streamrl.learner.ds_config import DeepSpeedConfig  # noqa: E402
from streamrl.learner.engine import ModelEngine, init_distributed  # noqa: E402
from streamrl.learner.logprobs import IGNORE_INDEX  # noqa: E402
from streamrl.learner.packing import Sample, pack_samples  # noqa: E402
from streamrl.learner.sft import SFTTask  # noqa: E402

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
    p.add_argument("--micro-batch", type=int, default=8, help="packed rows per micro-batch per GPU")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048, help="packed row length")
    p.add_argument("--min-sample", type=int, default=128, help="shortest random sample (tokens)")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_2", "eager"])
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument("--no-chunked-head", action="store_true", help="materialise the full-vocabulary logits")
    p.add_argument("--fused-adam", action="store_true", help="DeepSpeed FusedAdam instead of torch AdamW")
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


def main() -> int:
    args = parse_args()
    if args.tiny:
        args.seq_len, args.min_sample, args.micro_batch = min(args.seq_len, 128), 8, 2
        args.steps, args.warmup, args.zero_stage = min(args.steps, 3), 1, 0
    shape = TINY if args.tiny else FULL
    dtype = "fp32" if args.tiny else "bf16"
    init_distributed()
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
    )
    model_dir = build_random_model(shape, dtype, args.seq_len, rank)
    engine = ModelEngine.from_config(str(model_dir), cfg)
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(model_dir.parent, ignore_errors=True)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())

    per_step_rows = args.micro_batch * args.grad_accum
    total_steps = args.warmup + args.steps
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
    task = SFTTask(pad_id=0, packed=True, chunked_head=not args.no_chunked_head)
    device = engine.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    tokens = 0
    flops = 0.0
    start = 0.0
    loss = float("nan")
    for step in range(total_steps):
        if step == args.warmup:
            sync()
            torch.distributed.barrier()
            start = time.perf_counter()
            tokens, flops = 0, 0.0
        step_rows = rows[step * per_step_rows : (step + 1) * per_step_rows]
        for m in range(args.grad_accum):
            micro = step_rows[m * args.micro_batch : (m + 1) * args.micro_batch]
            out, _ = task.train_loss(engine, micro)
            engine.backward(out)
            engine.step()
            loss = float(out.detach())
            positions = torch.tensor([r.position_ids for r in micro])
            tokens += positions.numel()
            flops += 6.0 * n_params * positions.numel() + attention_flops(
                positions, shape["num_hidden_layers"], shape["hidden_size"]
            )
    sync()
    elapsed = time.perf_counter() - start
    totals = torch.tensor([tokens, flops], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(totals)
    tokens_all, flops_all = totals.tolist()
    result = {
        "bench": "sft_gpu",
        "tiny": args.tiny,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "world_size": world,
        "params": n_params,
        "dtype": dtype,
        "zero_stage": args.zero_stage,
        "attn": args.attn,
        "grad_ckpt": args.grad_ckpt,
        "optimizer": "FusedAdam" if args.fused_adam else "torch AdamW",
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "timed_steps": args.steps,
        "seconds": elapsed,
        "tokens_per_s": tokens_all / elapsed,
        "tokens_per_s_per_gpu": tokens_all / elapsed / world,
        "tflops_per_gpu": flops_all / elapsed / world / 1e12,
        "mfu": flops_all / elapsed / (PEAK_FLOPS * world),
        "peak_flops_per_gpu": PEAK_FLOPS,
        "last_loss": loss,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    if rank == 0:
        out_dir = REPO / "bench" / "results"
        out_dir.mkdir(parents=True, exist_ok=True)
        name = f"sft_gpu_{'tiny_' if args.tiny else ''}{time.strftime('%Y%m%d_%H%M%S')}.json"
        (out_dir / name).write_text(json.dumps(result, indent=2))
        print(
            f"tokens/s {result['tokens_per_s']:.0f}  MFU {100 * result['mfu']:.1f}% (peak {PEAK_FLOPS:.3g} FLOP/s/GPU)"
        )
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
