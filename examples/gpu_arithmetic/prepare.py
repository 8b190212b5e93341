"""Prepare the GPU arithmetic task: a Qwen2-0.5B-shaped policy, warm-started on the GPU, and its data.

    python examples/gpu_arithmetic/prepare.py recipes/gpu_arithmetic.toml [--prepare.field=value ...]

A random policy learns nothing in a few dozen RL steps (GRPO needs groups whose samples disagree),
so as the CPU demo does for its tiny model (``examples/arithmetic/prepare.py``), this builds the
policy locally and trains it briefly on (prompt, answer + end-of-sequence) pairs until its held-out
greedy accuracy reaches ``target_accuracy``; RL then has room to show learning. The differences
from the CPU demo: the Qwen2-0.5B shape (``examples/arithmetic/qwen2_model.py``: random init, the
real Qwen2 tokenizer), the warm start on the GPU with bf16 autocast over float32 weights and AdamW
(a 0.5B model on a CPU would take hours), and the policy saved in bfloat16, whose accuracy is
measured again after the cast (that is what the engine serves).

Settings come from the recipe's ``[prepare]`` table, then ``--prepare.field=value`` overrides. Writes into
``out_dir``: ``train.jsonl`` / ``eval.jsonl`` (disjoint prompts), ``model/`` (the warm-started
policy and tokenizer) and ``prepare.json`` (the settings and a summary). Idempotent: when
``prepare.json`` holds the same settings, nothing is redone.

Accuracy is the teacher-forced greedy accuracy of ``examples/arithmetic/warmstart.py`` (one forward
pass; exact for canonical answers).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from streamrl.common.config import BaseConfig, load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "arithmetic"))  # the CPU demo's task and model files

import qwen2_model as qwen2_lib
import task as task_lib
import warmstart as warmstart_lib

logger = logging.getLogger(__name__)


class GpuPrepareConfig(BaseConfig):
    """What to prepare: the task, the policy's shape and its warm start."""

    out_dir: str = "runs/gpu_arithmetic_data"
    """Output folder (data, model/, prepare.json)."""
    preset: Literal["qwen2_0.5b", "qwen2_1.5b", "qwen2.5_7b", "qwen2_tiny"] = "qwen2_0.5b"
    """Policy shape (``qwen2_model.SHAPES``); qwen2_tiny runs on a CPU in seconds (the tests)."""
    digits: int = Field(2, ge=1, le=30)
    """Operands are integers in [0, 10**digits); addition."""
    num_eval: int = Field(500, ge=1)
    """Held-out problems."""
    seed: int = 0
    """Seed of the problems, the init and the batch order."""
    target_accuracy: float = Field(0.3, gt=0.0, le=1.0)
    """The warm start stops once held-out greedy accuracy (float32 weights) reaches this."""
    max_steps: int = Field(1500, ge=1)
    """Warm-start step cap (the policy is saved either way; the summary says what it reached)."""
    batch_size: int = Field(128, ge=1)
    """Examples per warm-start step."""
    lr: float = Field(3e-4, gt=0.0)
    """AdamW peak learning rate."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up of the learning rate (steps)."""
    eval_every_steps: int = Field(10, ge=1)
    """Held-out accuracy check period (every step once half the target is reached)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to warm-start: auto = cuda when there is a GPU."""


def lr_at(step: int, config: GpuPrepareConfig) -> float:
    """Learning rate of (1-based) ``step``: linear warm-up, then constant."""
    if config.warmup_steps and step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    return config.lr


def settings(config: GpuPrepareConfig) -> dict[str, Any]:
    """What determines the output (everything but the output folder)."""
    return config.model_dump(exclude={"out_dir"})


def warm_start(
    model: Any,
    tokenizer: Any,
    train: list[tuple[str, str]],
    held_out: list[tuple[str, str]],
    config: GpuPrepareConfig,
    device: str,
) -> dict[str, Any]:
    """Train ``model`` (float32, on ``device``) in place until ``config.target_accuracy``; return a summary."""
    import torch

    def batch(rows: list[tuple[str, str]]) -> tuple[torch.Tensor, ...]:
        encoded = warmstart_lib.encode(tokenizer, [p for p, _ in rows], [r for _, r in rows])
        return tuple(t.to(device) for t in encoded)

    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda")
    eval_batch = batch(held_out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0, fused=device == "cuda")
    generator = torch.Generator().manual_seed(config.seed)
    started, step, accuracy, loss = time.perf_counter(), 0, 0.0, math.nan
    model.train()
    while step < config.max_steps and accuracy < config.target_accuracy:
        order = torch.randperm(len(train), generator=generator).tolist()
        for begin in range(0, len(order) - config.batch_size + 1, config.batch_size):
            step += 1
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config)
            with autocast:
                loss_t = warmstart_lib.sft_loss(
                    model, batch([train[i] for i in order[begin : begin + config.batch_size]])
                )
            optimizer.zero_grad(set_to_none=True)
            loss_t.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % config.eval_every_steps == 0 or accuracy >= config.target_accuracy / 2:
                loss = loss_t.item()
                model.eval()
                with autocast:
                    accuracy = warmstart_lib.greedy_accuracy(model, eval_batch)
                model.train()
                logger.info("warm start step %d loss %.4f held-out greedy accuracy %.3f", step, loss, accuracy)
            if accuracy >= config.target_accuracy or step >= config.max_steps:
                break
    model.eval()
    return {
        "warm_start_steps": step,
        "warm_start_loss": loss,
        "warm_start_accuracy": accuracy,
        "warm_start_s": round(time.perf_counter() - started, 2),
        "eval_batch": eval_batch,
    }


def prepare(config: GpuPrepareConfig) -> dict[str, Any]:
    """Write data and the warm-started policy into ``config.out_dir`` unless already there; return the summary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(config.out_dir)
    marker = out / "prepare.json"
    if marker.exists() and (out / "model" / "config.json").exists():
        done = json.loads(marker.read_text())
        if done.get("settings") == settings(config):
            logger.info("already prepared in %s; nothing to do", out)
            return dict(done["summary"])
    started = time.perf_counter()
    spec = task_lib.TaskSpec(operators="+", digits=config.digits, num_eval=config.num_eval, seed=config.seed)
    train, held_out = task_lib.make_splits(spec)
    task_lib.write_jsonl(out / "train.jsonl", train)
    task_lib.write_jsonl(out / "eval.jsonl", held_out)
    built = qwen2_lib.build(config.preset, out / "model", seed=config.seed)  # random weights + the Qwen2 tokenizer
    device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    model = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).to(device)
    warm = warm_start(
        model,
        tokenizer,
        [(p.prompt, p.response) for p in train],
        [(p.prompt, p.response) for p in held_out],
        config,
        device,
    )
    saved_dtype = getattr(torch, qwen2_lib.SHAPES[config.preset].dtype)
    model = model.to(saved_dtype)
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=False):
        saved_accuracy = warmstart_lib.greedy_accuracy(model, warm.pop("eval_batch"))
    model.save_pretrained(out / "model", safe_serialization=True)
    summary = {
        **built,
        "num_train": len(train),
        "num_eval": len(held_out),
        **warm,
        "saved_dtype": str(saved_dtype).removeprefix("torch."),
        "saved_accuracy": saved_accuracy,
        "device": device,
        "prepare_s": round(time.perf_counter() - started, 2),
    }
    marker.write_text(json.dumps({"settings": settings(config), "summary": summary}, indent=2))
    return summary


def main(argv: list[str]) -> None:
    """Parse ``[recipe] [--prepare.field=value ...]`` and prepare."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    recipe = argv[0] if argv and not argv[0].startswith("--") else None
    config = load_config(GpuPrepareConfig, recipe, argv[1:] if recipe else argv, section="prepare")
    summary = prepare(config)
    print(json.dumps({"out_dir": config.out_dir, **summary}))


if __name__ == "__main__":
    main(sys.argv[1:])
