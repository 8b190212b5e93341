"""Shared pieces of the end-to-end learning benchmarks (TRL, plain torch, streamrl) on the arithmetic task.

Each side trains the same warm-started model folder (``examples/arithmetic/prepare.py``) on the same
train split with the same GRPO settings and is judged the same way: greedy held-out accuracy, measured
with transformers ``generate`` on the saved policy every ``eval_every_steps`` steps, against the
wall-clock time spent in RL (evaluation time excluded). This module holds the settings, the data
loading, that evaluator and the summary of a learning curve; it imports torch only inside functions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TASK_FILE = ROOT / "examples" / "arithmetic" / "task.py"


@dataclass(frozen=True)
class BenchSettings:
    """One end-to-end GRPO run on a prepared arithmetic folder.

    Example:
        >>> BenchSettings(data_dir="runs/arith_a", prompts_per_step=32, group_size=8, lr=1e-4)
    """

    data_dir: str = "runs/arith_a"
    """Folder written by prepare.py (train.jsonl, eval.jsonl, model/)."""
    prompts_per_step: int = 32
    """Distinct prompts per optimizer step."""
    group_size: int = 8
    """Samples per prompt (GRPO group)."""
    lr: float = 1e-4
    """Adam learning rate (constant after warm-up); 3e-4 and above collapsed the warm-started policy."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up (steps), then constant."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    max_new_tokens: int = 6
    """Generation cap per sample."""
    max_steps: int = 200
    """Stop after this many optimizer steps."""
    time_budget_s: float = 600.0
    """Stop once this much RL time (evaluation excluded) has passed."""
    eval_every_steps: int = 5
    """Held-out evaluation period (steps); step 0 is always evaluated."""
    num_eval: int | None = None
    """Held-out prompts to evaluate; None = all of eval.jsonl."""
    target_gain: float = 0.4
    """Report the RL time at which accuracy first reaches start + target_gain."""
    stop_at_target: bool = False
    """End the run as soon as the target is reached."""
    epsilon: float = 0.2
    """PPO clip range (matters only with more than one update per batch)."""
    updates_per_step: int = 1
    """Optimizer steps per generation batch of ``prompts_per_step x group_size`` samples, each on an
    equal share of it (TRL ``steps_per_generation``; streamrl ``learner.mini_batches``). Steps are
    counted in generation batches on every side."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    seed: int = 0
    """Seed of prompt order and sampling."""
    num_threads: int = 2
    """torch intra-op threads."""
    bf16: bool = False
    """Train (and generate) in bfloat16 mixed precision (TRL's own default); False = float32."""
    device: str = "cpu"
    """Where the TRL side trains and generates: ``cpu`` or ``cuda`` (the GPU benchmark, bench/gpu_pipeline.py)."""
    dtype: str = "float32"
    """dtype the policy's weights are loaded in: ``float32`` or ``bfloat16`` (bf16 weights, as the GPU
    benchmark's rollout engine and learner compute)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Side-specific options (for example TRL config fields)."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for GRPO, got {self.group_size}")
        if (
            min(
                self.prompts_per_step,
                self.max_new_tokens,
                self.max_steps,
                self.eval_every_steps,
            )
            < 1
        ):
            raise ValueError(f"prompts_per_step, max_new_tokens, max_steps, eval_every_steps must be >= 1: {self}")
        if self.updates_per_step < 1 or (self.prompts_per_step * self.group_size) % self.updates_per_step:
            raise ValueError(f"updates_per_step must be >= 1 and divide prompts_per_step x group_size: {self}")
        if self.device not in ("cpu", "cuda") or self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"device must be cpu or cuda and dtype float32 or bfloat16: {self}")
        if self.lr <= 0 or self.temperature <= 0 or self.time_budget_s <= 0:
            raise ValueError(f"lr, temperature and time_budget_s must be positive: {self}")


def load_task() -> ModuleType:
    """Import examples/arithmetic/task.py by path, as the reward service does."""
    spec = importlib.util.spec_from_file_location("arithmetic_task", TASK_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def load_rows(
    settings: BenchSettings,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, held-out rows) of the prepared folder."""
    task = load_task()
    data = Path(settings.data_dir)
    train, held_out = (
        task.read_jsonl(data / "train.jsonl"),
        task.read_jsonl(data / "eval.jsonl"),
    )
    if settings.num_eval is not None:
        held_out = held_out[: settings.num_eval]
    return train, held_out


def prompt_order(train: list[dict[str, Any]], num_prompts: int, seed: int) -> list[dict[str, Any]]:
    """The training prompts in the order every side consumes them (reshuffled each epoch)."""
    rng = random.Random(seed)
    order: list[dict[str, Any]] = []
    while len(order) < num_prompts:
        epoch = list(train)
        rng.shuffle(epoch)
        order.extend(epoch)
    return order[:num_prompts]


def greedy_accuracy(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int) -> float:
    """Held-out accuracy of greedy decoding with transformers ``generate``, scored by the task's reward."""
    import torch

    task = load_task()
    prompts = [r["prompt"] for r in rows]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    model.train(was_training)
    completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=False)
    queries = [p + c for p, c in zip(prompts, completions, strict=True)]
    result = task.reward_func(queries, prompts, [r["label"] for r in rows])
    return float(sum(result["rewards"]) / len(rows))


class Curve:
    """Accuracy against RL wall-clock: a stopwatch that excludes evaluation time."""

    def __init__(self, target_gain: float) -> None:
        self.target_gain = target_gain
        self.points: list[dict[str, float]] = []
        self._rl_s = 0.0
        self._since: float | None = None

    def resume(self) -> None:
        """Start counting RL time."""
        self._since = time.perf_counter()

    def pause(self) -> float:
        """Stop counting RL time; return the RL seconds so far."""
        if self._since is not None:
            self._rl_s += time.perf_counter() - self._since
            self._since = None
        return self._rl_s

    @property
    def rl_s(self) -> float:
        """RL seconds so far (including a running interval)."""
        running = time.perf_counter() - self._since if self._since is not None else 0.0
        return self._rl_s + running

    def add(self, step: int, accuracy: float, **extra: float) -> None:
        """Record one evaluation."""
        self.points.append(
            {
                "step": step,
                "rl_s": round(self.rl_s, 2),
                "accuracy": round(accuracy, 4),
                **extra,
            }
        )

    def reached_target(self) -> bool:
        """Whether the latest accuracy is at least start + target_gain."""
        return len(self.points) > 1 and self.points[-1]["accuracy"] >= self.points[0]["accuracy"] + self.target_gain

    def summary(self) -> dict[str, Any]:
        """Start / final / best accuracy and the first step and RL time at start + target_gain."""
        start = self.points[0]["accuracy"]
        hit = next((p for p in self.points if p["accuracy"] >= start + self.target_gain), None)
        return {
            "start_accuracy": start,
            "final_accuracy": self.points[-1]["accuracy"],
            "best_accuracy": max(p["accuracy"] for p in self.points),
            "target_accuracy": round(start + self.target_gain, 4),
            "target_step": hit["step"] if hit else None,
            "target_rl_s": hit["rl_s"] if hit else None,
            "curve": self.points,
        }


def settings_dict(settings: BenchSettings) -> dict[str, Any]:
    """The settings as plain JSON data."""
    return json.loads(json.dumps(asdict(settings)))


def parse_settings(argv: list[str], description: str | None = None) -> BenchSettings:
    """``--field value`` for every scalar field of :class:`BenchSettings`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(BenchSettings):
        if f.name == "extra":
            parser.add_argument(
                "--extra",
                type=json.loads,
                default={},
                help="JSON object of side-specific options",
            )
        elif f.type == "bool":
            parser.add_argument(f"--{f.name.replace('_', '-')}", action="store_true")
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" ")[0], float)
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    return BenchSettings(**vars(parser.parse_args(argv)))
