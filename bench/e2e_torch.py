"""Minimal plain-torch GRPO on the arithmetic task: the floor for what one learner step costs.

One loop, no services: sample ``prompts_per_step x group_size`` completions with transformers
``generate`` (temperature T), score them with the task's ``reward_func``, group-normalise the rewards
(``(r - mean) / (std + 1e-4)``, unbiased std, as TRL's default), then one Adam step on the
token-mean clipped surrogate over all completion tokens (EOS included, padding excluded). The batch
is used once, so the policy is exactly on-policy (ratio = 1, the clip never binds) and no reference
model is needed (beta = 0). Log-probs are those of ``logits / T``, the distribution sampled from.

    python bench/e2e_torch.py [--data-dir runs/arith_a] [--prompts-per-step 32] [--group-size 8]
        [--lr 1e-4] [--temperature 1.0] [--max-steps 200] [--time-budget-s 600]

Prints one line per evaluation, then one JSON object (settings, curve, steps/s, tokens/s) as the last line.
"""

from __future__ import annotations

import json
import sys
import time
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


def group_advantages(rewards: Any, group_size: int) -> Any:
    """``(r - mean_g) / (std_g + 1e-4)`` per group of consecutive samples (unbiased std)."""
    grouped = rewards.view(-1, group_size)
    mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + 1e-4)).view(-1)


def completion_mask(completion_ids: Any, eos_id: int) -> Any:
    """1 on completion tokens up to and including the first EOS, 0 after it."""
    import torch

    is_eos = completion_ids == eos_id
    after_eos = (torch.cumsum(is_eos.int(), dim=1) - is_eos.int()) > 0
    return (~after_eos).float()


def token_logprobs(
    model: Any,
    input_ids: Any,
    attention_mask: Any,
    num_completion: int,
    temperature: float,
) -> Any:
    """Log-probs [B, C] of the last ``num_completion`` tokens under ``logits / temperature``."""
    import torch

    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, -num_completion - 1 : -1] / temperature
    targets = input_ids[:, -num_completion:]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def run_torch(settings: BenchSettings) -> dict[str, Any]:
    """Run the plain-torch GRPO loop; return the summary (curve, steps/s, generated tokens/s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(settings.num_threads)
    torch.manual_seed(settings.seed)
    task = load_task()
    train, held_out = load_rows(settings)
    model_dir = str(Path(settings.data_dir) / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    warmup = max(settings.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    order = prompt_order(train, settings.prompts_per_step * settings.max_steps, settings.seed)

    curve = Curve(settings.target_gain)
    curve.add(0, greedy_accuracy(model, tokenizer, held_out, settings.max_new_tokens))
    print(json.dumps(curve.points[-1]), flush=True)
    num_tokens, gen_s, train_s, step = 0, 0.0, 0.0, 0
    curve.resume()
    while step < settings.max_steps and curve.rl_s < settings.time_budget_s:
        rows = order[step * settings.prompts_per_step : (step + 1) * settings.prompts_per_step]
        prompts = [r["prompt"] for r in rows for _ in range(settings.group_size)]
        labels = [r["label"] for r in rows for _ in range(settings.group_size)]

        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=settings.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=settings.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        num_prompt = enc["input_ids"].shape[1]
        completion_ids = out[:, num_prompt:]
        mask = completion_mask(completion_ids, tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=False)
        rewards = torch.tensor(
            task.reward_func([p + t for p, t in zip(prompts, texts, strict=True)], prompts, labels)["rewards"]
        )
        advantages = group_advantages(rewards, settings.group_size)
        t1 = time.perf_counter()

        model.train()
        attention_mask = torch.cat([enc["attention_mask"], mask.long()], dim=1)
        logp = token_logprobs(model, out, attention_mask, completion_ids.shape[1], settings.temperature)
        ratio = torch.exp(logp - logp.detach())  # one update per batch: old policy = current policy
        clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.epsilon)
        per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
        loss = (per_token * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        optimizer.step()
        scheduler.step()
        t2 = time.perf_counter()

        step += 1
        num_tokens += int(mask.sum())
        gen_s += t1 - t0
        train_s += t2 - t1
        if step % settings.eval_every_steps == 0:
            curve.pause()
            accuracy = greedy_accuracy(model, tokenizer, held_out, settings.max_new_tokens)
            curve.add(step, accuracy, reward=round(float(rewards.mean()), 4))
            print(json.dumps(curve.points[-1]), flush=True)
            if settings.stop_at_target and curve.reached_target():
                break
            curve.resume()
    rl_s = curve.pause()
    return {
        "side": "torch",
        "settings": settings_dict(settings),
        "steps": step,
        "rl_s": round(rl_s, 2),
        "steps_per_s": round(step / rl_s, 3),
        "generated_tokens_per_s": round(num_tokens / rl_s, 1),
        "generate_s_per_step": round(gen_s / max(step, 1), 4),
        "train_s_per_step": round(train_s / max(step, 1), 4),
        **curve.summary(),
    }


if __name__ == "__main__":
    print(json.dumps(run_torch(parse_settings(sys.argv[1:], __doc__))))
