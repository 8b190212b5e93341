"""Reward-model job: a scalar head trained on preference pairs with the Bradley-Terry loss.

The model is a Hugging Face sequence classifier with one label (a causal LM checkpoint gets a
fresh ``score`` head); the reward is its output at the last non-pad token. Loss:
``-log sigmoid(r_w - r_l - margin)`` (margin from the data when ``data.margin_key`` is set).
Eval metrics: ``loss``, ``accuracy`` (share of pairs with r_w > r_l), ``reward_mean`` and
``reward_std`` over all eval responses; the last two are written into the exported config so
that a reward service can normalise rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from streamrl.learner.engine import ModelEngine, load_tokenizer
from streamrl.learner.offline.config import RMConfig
from streamrl.learner.offline.data import Pair, build_pairs, train_eval_records
from streamrl.learner.offline.loop import LoopResult, run_training
from streamrl.learner.offline.losses import bradley_terry_loss
from streamrl.learner.packing import collate, sample_row


def pair_rewards(engine: ModelEngine, pairs: Sequence[Pair], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of the chosen and of the rejected responses, one forward for both."""
    rows = [sample_row(p.chosen) for p in pairs] + [sample_row(p.rejected) for p in pairs]
    batch = collate(rows, pad_id, packed=False)
    batch.pop("targets")
    rewards = engine(**batch).logits.squeeze(-1).float()
    return rewards[: len(pairs)], rewards[len(pairs) :]


class RewardModelTask:
    """Bradley-Terry loss and pairwise accuracy."""

    default_best_metric = "accuracy"

    def __init__(self, pad_id: int, use_margin: bool) -> None:
        self.pad_id = pad_id
        self.use_margin = use_margin

    def _loss(self, engine: ModelEngine, pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen, rejected = pair_rewards(engine, pairs, self.pad_id)
        margin = torch.tensor([p.margin for p in pairs], device=chosen.device) if self.use_margin else None
        return bradley_terry_loss(chosen, rejected, margin), chosen.detach(), rejected.detach()

    def train_loss(self, engine: ModelEngine, items: Sequence[Pair]) -> tuple[torch.Tensor, dict[str, float]]:
        loss, chosen, rejected = self._loss(engine, items)
        return loss, {
            "accuracy": float((chosen > rejected).float().mean()),
            "margin": float((chosen - rejected).mean()),
        }

    def eval_sums(self, engine: ModelEngine, items: Sequence[Pair]) -> dict[str, float]:
        loss, chosen, rejected = self._loss(engine, items)
        both = torch.cat([chosen, rejected])
        return {
            "loss": float(loss) * len(items),
            "correct": float((chosen > rejected).sum()),
            "pairs": float(len(items)),
            "reward_sum": float(both.sum()),
            "reward_sq": float((both**2).sum()),
        }

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["pairs"], 1.0)
        mean = sums["reward_sum"] / (2 * n)
        var = max(sums["reward_sq"] / (2 * n) - mean**2, 0.0)
        return {
            "loss": sums["loss"] / n,
            "accuracy": sums["correct"] / n,
            "reward_mean": mean,
            "reward_std": math.sqrt(var),
        }

    def export_config(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {"reward_mean": metrics["reward_mean"], "reward_std": metrics["reward_std"]}


def run_rm(cfg: RMConfig) -> LoopResult:
    """Run a reward-model job end to end (resuming from ``train.run_dir`` when it holds a checkpoint)."""
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    pad_id = int(tokenizer.pad_token_id)
    train_records, eval_records = train_eval_records(cfg.data, cfg.deepspeed.seed)
    train_pairs = build_pairs(train_records, tokenizer, cfg.data)
    eval_pairs = build_pairs(eval_records, tokenizer, cfg.data) if eval_records else []

    def make_engine(total_steps: int) -> ModelEngine:
        return ModelEngine.from_config(
            cfg.model.path,
            cfg.deepspeed,
            "reward",
            lora=cfg.model.lora,
            total_steps=total_steps,
            tokenizer_path=cfg.model.tokenizer_path,
        )

    task = RewardModelTask(pad_id, use_margin=cfg.data.margin_key is not None)
    return run_training(
        task, make_engine, train_pairs, eval_pairs, cfg.train, cfg.logging, cfg.deepspeed, cfg.model_dump()
    )
