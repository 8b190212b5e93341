"""Warm start: a short supervised run that brings the random policy to a useful starting accuracy.

GRPO learns only from groups whose samples disagree, so a policy at 0% (or 100%) gives no signal.
This plain-torch loop trains on (prompt, response + EOS) pairs with the prompt masked out of the
loss, and stops as soon as the held-out greedy accuracy reaches ``target_accuracy`` (checked every
``eval_every_steps``, and after every step once half the target is reached: near the end accuracy
jumps, 27% -> 43% between steps 240 and 250 on one machine type, where checks every 10 steps
overshot to 43%), leaving room for RL to show learning. Seeded: with checks every 10 steps the
default settings stopped at step 250 with 33.4% held-out accuracy on two fresh machines (~22 s with
2 uncontended threads).
Batch 128 at lr 1e-3 was the fastest of the settings tried; lr 3e-3 oscillated and did not get there.

Greedy accuracy here is measured by teacher forcing: greedy decoding reproduces the target answer
exactly iff the argmax at every response position (EOS included) is the target token, so one
forward pass gives the exact greedy accuracy on canonical answers (decoding could only add the rare
non-canonical correct answer, such as a leading zero).

To move onto the learner's SFT job (``streamrl sft``) once that exists; this file stays as the
minimal reference.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStartSpec:
    """Settings of the warm-start run."""

    target_accuracy: float = 0.3
    """Stop once held-out greedy accuracy reaches this."""
    max_steps: int = 3000
    """Hard cap on optimizer steps."""
    batch_size: int = 128
    """Examples per step."""
    lr: float = 1e-3
    """Adam learning rate (constant)."""
    eval_every_steps: int = 10
    """How often to measure held-out accuracy (every step once it reaches half the target)."""
    seed: int = 0
    """Seed of the batch order."""

    def __post_init__(self) -> None:
        if not 0.0 < self.target_accuracy <= 1.0:
            raise ValueError(f"target_accuracy must be in (0, 1], got {self.target_accuracy}")
        if min(self.max_steps, self.batch_size, self.eval_every_steps) < 1 or self.lr <= 0:
            raise ValueError(f"max_steps, batch_size, eval_every_steps and lr must be positive: {self}")


def encode(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], responses: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` [B, T] for prompt + response + EOS.

    ``loss_mask`` is 1 on the response and EOS tokens (the ones to predict), 0 on prompt and padding.
    """
    rows, masks = [], []
    for prompt, response in zip(prompts, responses, strict=True):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + r)
        masks.append([0] * len(p) + [1] * len(r))
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        loss_mask[i, : len(row)] = torch.tensor(mask)
    return input_ids, attention_mask, loss_mask


def sft_loss(model: PreTrainedModel, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Token-mean cross-entropy over the response tokens of ``batch`` (from :func:`encode`)."""
    input_ids, attention_mask, loss_mask = batch
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    targets, mask = input_ids[:, 1:], loss_mask[:, 1:].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (nll * mask).sum() / mask.sum()


@torch.no_grad()
def greedy_accuracy(
    model: PreTrainedModel,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    chunk_size: int = 512,
) -> float:
    """Fraction of examples whose greedy decode is exactly the target response + EOS (teacher forcing)."""
    input_ids, attention_mask, loss_mask = batch
    num_exact = 0
    for start in range(0, len(input_ids), chunk_size):
        ids, att, mask = (t[start : start + chunk_size] for t in (input_ids, attention_mask, loss_mask))
        predicted = model(input_ids=ids, attention_mask=att).logits[:, :-1].argmax(-1)
        wrong = (predicted != ids[:, 1:]) & mask[:, 1:].bool()
        num_exact += int((~wrong.any(dim=1)).sum())
    return num_exact / len(input_ids)


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train: list[tuple[str, str]],
    held_out: list[tuple[str, str]],
    spec: WarmStartSpec,
) -> dict[str, float]:
    """Train ``model`` in place on (prompt, response) pairs until ``spec.target_accuracy``; return a summary."""
    generator = torch.Generator().manual_seed(spec.seed)
    eval_batch = encode(tokenizer, [p for p, _ in held_out], [r for _, r in held_out])
    optimizer = torch.optim.Adam(model.parameters(), lr=spec.lr)
    start_s = time.perf_counter()
    accuracy, step = 0.0, 0
    model.train()
    while step < spec.max_steps:
        order = torch.randperm(len(train), generator=generator)
        for begin in range(0, len(order) - spec.batch_size + 1, spec.batch_size):
            rows = [train[i] for i in order[begin : begin + spec.batch_size].tolist()]
            loss = sft_loss(model, encode(tokenizer, [p for p, _ in rows], [r for _, r in rows]))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % spec.eval_every_steps == 0 or accuracy >= spec.target_accuracy / 2:
                model.eval()
                accuracy = greedy_accuracy(model, eval_batch)
                model.train()
                logger.info(
                    "warm start step %d loss %.4f held-out greedy accuracy %.3f",
                    step,
                    loss.item(),
                    accuracy,
                )
                if accuracy >= spec.target_accuracy:
                    break
            if step >= spec.max_steps:
                break
        if accuracy >= spec.target_accuracy:
            break
    model.eval()
    return {
        "steps": step,
        "accuracy": accuracy,
        "seconds": time.perf_counter() - start_s,
    }
