"""The TRL side of the end-to-end learning benchmark: GRPOTrainer on the arithmetic task.

Runs TRL's ``GRPOTrainer`` (its default transformers generation, ``beta = 0``, default loss) on the
warm-started folder from ``examples/arithmetic/prepare.py``, with ``updates_per_step`` optimizer steps
(default one) per generation batch of ``prompts_per_step x group_size`` completions (steps are
counted in generation batches, as on the other sides), a constant learning rate and the task's own
``reward_func``. Every ``eval_every_steps`` steps
a callback pauses the RL clock and measures greedy held-out accuracy (``bench/e2e_common.py``).

    python bench/e2e_trl.py [--data-dir runs/arith_a] [--prompts-per-step 32] [--group-size 8]
        [--lr 1e-4] [--max-steps 200] [--time-budget-s 600] [--extra '{"loss_type": "grpo"}']
        [--device cuda --dtype bfloat16 --bf16]   (the GPU benchmark, bench/gpu_pipeline.py)

Prints one line per evaluation, then one JSON object (settings, curve, steps/s, generated tokens/s,
RL time to start + target_gain) as the last line. ``extra`` holds more ``GRPOConfig`` fields.
Importable: ``run_trl(settings) -> dict``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_common import (
    BenchSettings,
    Curve,
    greedy_accuracy,
    load_rows,
    load_task,
    parse_settings,
    prompt_order,
    settings_dict,
)


def run_trl(settings: BenchSettings) -> dict[str, Any]:
    """Run TRL GRPOTrainer under ``settings``; return the summary (curve, steps/s, generated tokens/s)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(settings.num_threads)
    task = load_task()
    train, held_out = load_rows(settings)
    model_dir = str(Path(settings.data_dir) / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, settings.dtype))
    # The same prompt order as the other sides; TRL's own shuffling is turned off.
    rows = prompt_order(train, settings.prompts_per_step * settings.max_steps, settings.seed)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows])

    curve = Curve(settings.target_gain)
    updates = settings.updates_per_step  # optimizer steps per generation batch (TRL's global_step counts them)
    counters = {"tokens": 0, "steps": 0}
    step_end_s: list[float] = []  # RL clock at the end of each step (generation batch)

    def arithmetic_reward(
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        label: list[str],
        **_: Any,
    ) -> list[float]:
        counters["tokens"] += sum(len(ids) for ids in completion_ids)
        queries = [p + c for p, c in zip(prompts, completions, strict=True)]
        return [float(r) for r in task.reward_func(queries, prompts, label)["rewards"]]

    class EvalEvery(TrainerCallback):
        """Greedy held-out accuracy every ``eval_every_steps`` steps, outside the RL clock; stop rules."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            curve.add(0, greedy_accuracy(model, tokenizer, held_out, settings.max_new_tokens))
            print(json.dumps(curve.points[-1]), flush=True)
            curve.resume()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            counters["steps"] = state.global_step // updates
            if state.global_step % updates == 0:
                step_end_s.append(round(curve.rl_s, 3))
            if curve.rl_s >= settings.time_budget_s:
                control.should_training_stop = True
            if state.global_step % (settings.eval_every_steps * updates) == 0:
                curve.pause()
                curve.add(
                    state.global_step // updates,
                    greedy_accuracy(model, tokenizer, held_out, settings.max_new_tokens),
                )
                print(json.dumps(curve.points[-1]), flush=True)
                if settings.stop_at_target and curve.reached_target():
                    control.should_training_stop = True
                curve.resume()

    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            use_cpu=settings.device == "cpu",
            bf16=settings.bf16,
            seed=settings.seed,
            max_steps=settings.max_steps * updates,
            learning_rate=settings.lr,
            lr_scheduler_type="constant_with_warmup",
            warmup_steps=settings.warmup_steps,
            optim="adamw_torch",
            weight_decay=0.0,
            max_grad_norm=settings.max_grad_norm,
            per_device_train_batch_size=settings.prompts_per_step * settings.group_size // updates,
            gradient_accumulation_steps=1,
            steps_per_generation=updates,
            num_generations=settings.group_size,
            max_completion_length=settings.max_new_tokens,
            temperature=settings.temperature,
            epsilon=settings.epsilon,
            beta=0.0,
            shuffle_dataset=False,
            logging_steps=settings.eval_every_steps,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            **settings.extra,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=arithmetic_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[EvalEvery()],
        )
        trainer.train()
    rl_s = curve.pause()
    steps = counters["steps"]
    return {
        "side": "trl",
        "settings": settings_dict(settings),
        "updates_per_step": updates,
        "steps": steps,
        "rl_s": round(rl_s, 2),
        "steps_per_s": round(steps / rl_s, 3),
        "generated_tokens_per_s": round(counters["tokens"] / rl_s, 1),
        "generated_tokens": counters["tokens"],
        "step_end_s": step_end_s,
        **curve.summary(),
    }


if __name__ == "__main__":
    print(json.dumps(run_trl(parse_settings(sys.argv[1:], __doc__))))
