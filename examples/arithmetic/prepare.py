"""Prepare the arithmetic demo: data splits, tokenizer, tiny model and its warm start, in one command.

    python examples/arithmetic/prepare.py [recipe.toml] [--field=value ...]

Settings come from the recipe's ``[prepare]`` table, then ``--field=value`` overrides.

Writes into ``out_dir``:

* ``train.jsonl`` / ``eval.jsonl``: ``{"prompt", "label", "response"}`` rows, disjoint prompts;
* ``model/``: the warm-started policy and tokenizer (loads in transformers, TRL and vLLM);
  with the ``qwen2_*`` presets a random Qwen2-shaped policy and the real Qwen2 tokenizer instead
  (no warm start; the GPU benchmark);
* ``prepare.json``: the settings and a summary (parameters, warm-start steps and accuracy).

Idempotent: when ``prepare.json`` already holds the same settings, nothing is redone.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from streamrl.common.config import BaseConfig, load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling plain files, referenced by path

import model as model_lib
import qwen2_model as qwen2_lib
import task as task_lib
import warmstart as warmstart_lib

logger = logging.getLogger(__name__)


class PrepareConfig(BaseConfig):
    """What to prepare: the task, the model preset and the warm start."""

    out_dir: str = "runs/arithmetic"
    """Output folder (data, model/, prepare.json)."""
    preset: Literal["small", "large", "qwen2_0.5b", "qwen2_1.5b", "qwen2.5_7b", "qwen2_tiny"] = "small"
    """Model shape: small = 0.66M parameters (workload a); large = 27M (workload b); qwen2_0.5b = a
    randomly initialised Qwen2-0.5B-shaped policy with the real Qwen2 tokenizer and no warm start
    (the GPU benchmark, ``qwen2_model.py``); qwen2_tiny = the same at a size a CPU runs in seconds."""
    operators: str = "+"
    """Operators, a subset of "+-*"."""
    digits: int = Field(2, ge=1, le=30)
    """Operands are integers in [0, 10**digits)."""
    num_eval: int = Field(500, ge=1)
    """Held-out problems."""
    num_train: int | None = Field(None, ge=1)
    """Training problems; None = all the rest (capped at 200,000 when sampled)."""
    scratchpad: bool = False
    """Column-by-column trace before the answer (workload b; addition only)."""
    seed: int = 0
    """Seed of the problems, the model init and the warm-start batch order."""
    target_accuracy: float = Field(0.3, gt=0.0, le=1.0)
    """Warm start stops once held-out greedy accuracy reaches this."""
    max_steps: int = Field(3000, ge=1)
    """Warm-start step cap."""
    batch_size: int = Field(128, ge=1)
    """Warm-start examples per step."""
    lr: float = Field(1e-3, gt=0.0)
    """Warm-start Adam learning rate."""
    eval_every_steps: int = Field(10, ge=1)
    """Warm-start accuracy check period (steps)."""


WARM_START_VERSION = 2
"""Bumped when the warm start's procedure changes, so that folders prepared by the old one are redone
(2: accuracy checked after every step once half the target is reached)."""


def _settings(config: PrepareConfig) -> dict[str, Any]:
    """The settings that determine the output (everything but the output folder)."""
    return {**config.model_dump(exclude={"out_dir"}), "warm_start_version": WARM_START_VERSION}


def prepare(config: PrepareConfig) -> dict[str, Any]:
    """Write data, model and warm start into ``config.out_dir`` unless already there; return the summary."""
    import torch

    out = Path(config.out_dir)
    marker = out / "prepare.json"
    if marker.exists():
        done = json.loads(marker.read_text())
        if done.get("settings") == _settings(config) and (out / "model" / "config.json").exists():
            logger.info("already prepared in %s; nothing to do", out)
            return dict(done["summary"])
    task_spec = task_lib.TaskSpec(
        operators=config.operators,
        digits=config.digits,
        num_eval=config.num_eval,
        num_train=config.num_train,
        scratchpad=config.scratchpad,
        seed=config.seed,
    )
    train, held_out = task_lib.make_splits(task_spec)
    task_lib.write_jsonl(out / "train.jsonl", train)
    task_lib.write_jsonl(out / "eval.jsonl", held_out)
    if config.preset in qwen2_lib.SHAPES:
        return _prepare_qwen2(config, marker, len(train), len(held_out))

    torch.manual_seed(config.seed)
    tokenizer = model_lib.build_tokenizer()
    model_spec = model_lib.PRESETS[config.preset]
    longest = max(len(p.prompt) + len(p.response) + 1 for p in train + held_out)
    if longest > model_spec.max_positions:
        raise ValueError(
            f"preset {config.preset!r} holds {model_spec.max_positions} positions but the longest problem "
            f"needs {longest}: use fewer digits or the large preset"
        )
    policy = model_lib.build_model(model_spec, tokenizer, seed=config.seed)
    warm = warmstart_lib.warm_start(
        policy,
        tokenizer,
        [(p.prompt, p.response) for p in train],
        [(p.prompt, p.response) for p in held_out],
        warmstart_lib.WarmStartSpec(
            target_accuracy=config.target_accuracy,
            max_steps=config.max_steps,
            batch_size=config.batch_size,
            lr=config.lr,
            eval_every_steps=config.eval_every_steps,
            seed=config.seed,
        ),
    )
    model_lib.save(policy, tokenizer, out / "model")
    summary = {
        "num_parameters": model_lib.num_parameters(policy),
        "num_train": len(train),
        "num_eval": len(held_out),
        "max_prompt_tokens": max(len(p.prompt) for p in train + held_out),
        "max_response_tokens": max(len(p.response) + 1 for p in train + held_out),
        "warm_start_steps": warm["steps"],
        "warm_start_accuracy": warm["accuracy"],
        "warm_start_s": round(warm["seconds"], 2),
    }
    marker.write_text(json.dumps({"settings": _settings(config), "summary": summary}, indent=2))
    return summary


def _prepare_qwen2(config: PrepareConfig, marker: Path, num_train: int, num_eval: int) -> dict[str, Any]:
    """The qwen2 presets: a random Qwen2-shaped policy with the real tokenizer; no warm start (the
    warm-start fields are ignored: a benchmark of speed, not of learning)."""
    started = time.perf_counter()
    summary = {
        **qwen2_lib.build(config.preset, Path(config.out_dir) / "model", seed=config.seed),
        "num_train": num_train,
        "num_eval": num_eval,
        "build_s": round(time.perf_counter() - started, 2),
    }
    marker.write_text(json.dumps({"settings": _settings(config), "summary": summary}, indent=2))
    return summary


def main(argv: list[str]) -> None:
    """Parse ``[recipe] [--field=value ...]`` and prepare."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    recipe = argv[0] if argv and not argv[0].startswith("--") else None
    config = load_config(PrepareConfig, recipe, argv[1:] if recipe else argv, section="prepare")
    start_s = time.perf_counter()
    summary = prepare(config)
    logger.info("prepared %s in %.1f s", config.out_dir, time.perf_counter() - start_s)
    print(json.dumps({"out_dir": config.out_dir, **summary}))


if __name__ == "__main__":
    main(sys.argv[1:])
