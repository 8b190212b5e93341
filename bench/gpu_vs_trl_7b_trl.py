"""The TRL side of ``bench/gpu_vs_trl_7b.py``: GRPOTrainer with a peft LoRA adapter, as a user writes it.

One script, launched as its own process: it reads the settings the harness wrote (the common vocabulary
of :data:`gpu_vs_trl_7b.PARITY_FIELDS`), builds ``GRPOConfig`` and peft's ``LoraConfig`` from them, and
trains on the arithmetic task's prompts with the task's own reward. On a GPU it generates with vLLM in
colocate mode (vLLM in this process, on the training GPU; TRL merges the adapter into the base and loads
the merged weights into vLLM before each generation); on the CPU smoke, with transformers ``generate``.

A ``TrainerCallback`` appends one JSON line per event to ``--events``: ``train_begin``, every optimizer
step's end (``step``), every checkpoint save (``save``), and after ``trainer.save_model`` the final
save (``saved``), each with its wall-clock ``time``. ``--dry-run`` builds the two configs, prints the
settings read back from them (the harness compares those with streamrl's) and loads nothing.

    python bench/gpu_vs_trl_7b_trl.py --settings SETTINGS.json --events EVENTS.jsonl [--dry-run]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_common import load_task, prompt_order

LOSS_TYPES = {"dapo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
"""TRL ``loss_type`` -> streamrl ``learner.algo.loss.aggregation`` (how per-token losses are averaged)."""


def build_configs(s: dict[str, Any], output_dir: str) -> tuple[Any, Any]:
    """``(GRPOConfig, peft LoraConfig)`` for the settings ``s``."""
    from peft import LoraConfig
    from trl import GRPOConfig

    gpu = s["device"] == "cuda"
    loss_type = next(k for k, v in LOSS_TYPES.items() if v == s["loss_aggregation"])
    grpo = GRPOConfig(
        output_dir=output_dir,
        use_cpu=not gpu,
        bf16=s["dtype"] == "bfloat16",
        seed=s["seed"],
        max_steps=s["steps"],
        learning_rate=s["lr"],
        lr_scheduler_type=s["scheduler"],
        warmup_steps=s["warmup_steps"],
        optim="adamw_torch_fused" if gpu else "adamw_torch",
        adam_beta1=s["betas"][0],
        adam_beta2=s["betas"][1],
        adam_epsilon=s["eps"],
        weight_decay=s["weight_decay"],
        max_grad_norm=s["grad_clip"],
        per_device_train_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=s["grad_accum"],
        num_generations=s["group_size"],
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_p=s["top_p"],
        top_k=max(s["top_k"], 0),
        beta=s["kl_coef"],
        epsilon=s["clip_eps_low"],
        epsilon_high=s["clip_eps_high"],
        loss_type=loss_type,
        scale_rewards="group" if s["advantage"] == "grpo" else "none",
        gradient_checkpointing=s["gradient_checkpointing"],
        model_init_kwargs={"dtype": s["dtype"]},
        use_vllm=s["vllm"],
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=s["gpu_memory_utilization"],
        vllm_max_model_length=s["max_model_len"],
        save_strategy="steps",
        save_steps=s["checkpoint_every"],
        shuffle_dataset=False,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(
        r=s["lora_rank"],
        lora_alpha=s["lora_alpha"],
        lora_dropout=s["lora_dropout"],
        target_modules=s["lora_target_modules"],
        task_type="CAUSAL_LM",
    )
    return grpo, lora


def settings_of(grpo: Any, lora: Any, model: str, device: str) -> dict[str, Any]:
    """The settings TRL will run with, read back from its configs, in the harness's vocabulary."""
    samples = grpo.per_device_train_batch_size * grpo.steps_per_generation
    return {
        "model": model,
        "device": device,
        "dtype": "bfloat16" if grpo.bf16 else "float32",
        "lora_rank": lora.r,
        "lora_alpha": float(lora.lora_alpha),
        "lora_dropout": lora.lora_dropout,
        "lora_target_modules": lora.target_modules
        if isinstance(lora.target_modules, str)
        else sorted(lora.target_modules),
        "prompts_per_step": samples // grpo.num_generations,
        "group_size": grpo.num_generations,
        "max_new_tokens": grpo.max_completion_length,
        "max_model_len": grpo.vllm_max_model_length,
        "temperature": grpo.temperature,
        "top_p": grpo.top_p,
        "top_k": grpo.top_k if grpo.top_k > 0 else -1,
        "steps": grpo.max_steps,
        "seed": grpo.seed,
        "lr": grpo.learning_rate,
        "scheduler": str(getattr(grpo.lr_scheduler_type, "value", grpo.lr_scheduler_type)),
        "warmup_steps": grpo.warmup_steps,
        "optimizer": "adamw",
        "betas": [grpo.adam_beta1, grpo.adam_beta2],
        "eps": grpo.adam_epsilon,
        "weight_decay": grpo.weight_decay,
        "grad_clip": grpo.max_grad_norm,
        "micro_batch_size": grpo.per_device_train_batch_size,
        "grad_accum": grpo.gradient_accumulation_steps,
        "updates_per_step": grpo.num_iterations * grpo.steps_per_generation // grpo.gradient_accumulation_steps,
        "gradient_checkpointing": grpo.gradient_checkpointing,
        "kl_coef": grpo.beta,
        "clip_eps_low": grpo.epsilon,
        "clip_eps_high": grpo.epsilon_high,
        "loss_aggregation": LOSS_TYPES.get(grpo.loss_type, grpo.loss_type),
        "advantage": "grpo" if grpo.scale_rewards in ("group", True) else "dr_grpo",
        "vllm": grpo.use_vllm,
        "gpu_memory_utilization": grpo.vllm_gpu_memory_utilization if grpo.use_vllm else None,
        "max_num_seqs": samples * grpo.vllm_tensor_parallel_size if grpo.use_vllm else None,
        "checkpoint_every": grpo.save_steps,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True, help="JSON file of the run's settings (the harness writes it)")
    parser.add_argument("--events", default=None, help="JSONL file the step and save times are appended to")
    parser.add_argument("--dry-run", action="store_true", help="print the settings read back from TRL's configs")
    args = parser.parse_args(argv)
    s = json.loads(Path(args.settings).read_text())
    output_dir = s["trl_output_dir"]
    grpo, lora = build_configs(s, output_dir)
    if grpo.use_vllm and importlib.util.find_spec("vllm") is None:
        raise SystemExit(
            "use_vllm is set but vllm does not import here (GPU machine: bench/gpu_vs_trl_7b.sh installs it)"
        )
    if args.dry_run:
        print(json.dumps(settings_of(grpo, lora, s["model"], s["device"])))
        return

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    events = Path(args.events or Path(output_dir) / "events.jsonl")

    def log(event: str, **fields: Any) -> None:
        with events.open("a") as f:
            f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")

    task = load_task()
    train = task.read_jsonl(Path(s["data_dir"]) / "train.jsonl")
    rows = prompt_order(train, s["prompts_per_step"] * s["steps"], s["seed"])
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows])
    tokens = {"generated": 0}

    def arithmetic_reward(
        prompts: list[str], completions: list[str], completion_ids: list[list[int]], label: list[str], **_: Any
    ) -> list[float | None]:
        tokens["generated"] += sum(len(ids) for ids in completion_ids)
        queries = [p + c for p, c in zip(prompts, completions, strict=True)]
        return [float(r) for r in task.reward_func(queries, prompts, label)["rewards"]]

    class StepTimes(TrainerCallback):
        """Wall-clock time of every optimizer step's end and every checkpoint, one JSON line each."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            log("train_begin")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            log("step", step=state.global_step, generated_tokens=tokens["generated"])

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            log("save", step=state.global_step)

    trainer = GRPOTrainer(
        model=s["model"],
        reward_funcs=arithmetic_reward,
        args=grpo,
        train_dataset=dataset,
        peft_config=lora,
        callbacks=[StepTimes()],
    )
    trainer.train()
    trainer.save_model(str(Path(output_dir) / "final"))
    log("saved", step=trainer.state.global_step, generated_tokens=tokens["generated"])


if __name__ == "__main__":
    main(sys.argv[1:])
