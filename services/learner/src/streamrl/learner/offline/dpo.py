"""Preference-optimisation job: DPO, cDPO (label smoothing) or IPO against a frozen reference policy.

Sequence log-probs are summed over response tokens (prompt and padding masked). The reference
policy (``ref_model_path``, default the starting model) is either run once before training over
every pair, after which it is freed (``precompute_ref``, the default: no second model in memory
while training), or kept frozen beside the policy and run on every micro-batch.
Eval metrics: ``loss``, ``accuracy`` (share of pairs whose implicit reward margin is > 0),
``margin``, ``chosen_reward``, ``rejected_reward`` (implicit rewards, means over pairs).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from streamrl.learner.distributed import init_distributed
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.engine import ModelEngine, load_tokenizer
from streamrl.learner.lm_forward import rows_logprobs
from streamrl.learner.offline.config import DPOConfig
from streamrl.learner.offline.data import Pair, build_pairs, train_eval_records
from streamrl.learner.offline.loop import LoopResult, rank_batches, run_training
from streamrl.learner.offline.losses import masked_nll, preference_loss, sequence_logprob
from streamrl.learner.packing import sample_row


@dataclass(frozen=True, slots=True)
class RefPair:
    """A preference pair with its reference log-probs (None while they are computed live)."""

    pair: Pair
    ref_chosen: float | None = None
    ref_rejected: float | None = None


def pair_logprobs(
    engine: ModelEngine, pairs: Sequence[Pair], cfg: DeepSpeedConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed response log-probs of chosen and rejected (one flat varlen forward, fused head unless
    ``cfg`` says not), plus per-token log-probs and mask."""
    rows = [sample_row(p.chosen) for p in pairs] + [sample_row(p.rejected) for p in pairs]
    logprobs, mask = rows_logprobs(engine, rows, cfg)
    seq = sequence_logprob(logprobs, mask)
    return seq[: len(pairs)], seq[len(pairs) :], logprobs, mask


def reference_logprobs(
    engine: ModelEngine, pairs: Sequence[Pair], cfg: DeepSpeedConfig, micro_batch: int
) -> torch.Tensor:
    """``(len(pairs), 2)`` summed reference log-probs of (chosen, rejected), computed sharded over ranks."""
    out = torch.zeros(len(pairs), 2, dtype=torch.float64, device=engine.device)
    indices = list(range(len(pairs)))
    with torch.no_grad():
        for batch, real in rank_batches(indices, engine.rank, engine.world_size, micro_batch):
            chosen, rejected, _, _ = pair_logprobs(engine, [pairs[i] for i in batch], cfg)
            if real:
                out[batch, 0] = chosen.double()
                out[batch, 1] = rejected.double()
    torch.distributed.all_reduce(out)
    return out.cpu()


class DPOTask:
    """Preference loss over :class:`RefPair` items."""

    default_best_metric = "loss"

    def __init__(self, cfg: DPOConfig, ref_engine: ModelEngine | None) -> None:
        self.cfg = cfg
        self.ref_engine = ref_engine

    def _forward(self, engine: ModelEngine, items: Sequence[RefPair]) -> tuple[Any, torch.Tensor]:
        pairs = [it.pair for it in items]
        chosen, rejected, logprobs, mask = pair_logprobs(engine, pairs, self.cfg.deepspeed)
        if self.ref_engine is not None:
            with torch.no_grad():
                ref_c, ref_r, _, _ = pair_logprobs(self.ref_engine, pairs, self.cfg.deepspeed)
        else:
            ref_c = torch.tensor([it.ref_chosen for it in items], device=chosen.device, dtype=chosen.dtype)
            ref_r = torch.tensor([it.ref_rejected for it in items], device=chosen.device, dtype=chosen.dtype)
        out = preference_loss(
            chosen, rejected, ref_c, ref_r, self.cfg.beta, self.cfg.loss_type, self.cfg.label_smoothing
        )
        loss = out.loss
        if self.cfg.nll_coef > 0:
            n = len(items)
            loss = loss + self.cfg.nll_coef * masked_nll(logprobs[:n], mask[:n])
        return out, loss

    def train_loss(self, engine: ModelEngine, items: Sequence[RefPair]) -> tuple[torch.Tensor, dict[str, float]]:
        out, loss = self._forward(engine, items)
        margin = out.chosen_rewards - out.rejected_rewards
        return loss, {
            "accuracy": float((margin > 0).float().mean()),
            "margin": float(margin.mean()),
            "chosen_reward": float(out.chosen_rewards.mean()),
            "rejected_reward": float(out.rejected_rewards.mean()),
        }

    def eval_sums(self, engine: ModelEngine, items: Sequence[RefPair]) -> dict[str, float]:
        out, loss = self._forward(engine, items)
        margin = out.chosen_rewards - out.rejected_rewards
        return {
            "loss": float(loss) * len(items),
            "correct": float((margin > 0).sum()),
            "margin": float(margin.sum()),
            "chosen_reward": float(out.chosen_rewards.sum()),
            "rejected_reward": float(out.rejected_rewards.sum()),
            "pairs": float(len(items)),
        }

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["pairs"], 1.0)
        return {
            "loss": sums["loss"] / n,
            "accuracy": sums["correct"] / n,
            "margin": sums["margin"] / n,
            "chosen_reward": sums["chosen_reward"] / n,
            "rejected_reward": sums["rejected_reward"] / n,
        }

    def export_config(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {}


def _with_reference(pairs: list[Pair], ref: torch.Tensor) -> list[RefPair]:
    return [RefPair(p, float(ref[i, 0]), float(ref[i, 1])) for i, p in enumerate(pairs)]


def run_dpo(cfg: DPOConfig) -> LoopResult:
    """Run a DPO / cDPO / IPO job end to end (resuming from ``train.run_dir`` when it holds a checkpoint)."""
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    train_records, eval_records = train_eval_records(cfg.data, cfg.deepspeed.seed)
    train_pairs = build_pairs(train_records, tokenizer, cfg.data)
    eval_pairs = build_pairs(eval_records, tokenizer, cfg.data) if eval_records else []

    init_distributed()
    ref_engine = ModelEngine.from_config(
        cfg.ref_model_path or cfg.model.path,
        cfg.deepspeed,
        "causal_lm",
        train=False,
        tokenizer_path=cfg.model.tokenizer_path,
    )
    if cfg.precompute_ref:
        micro = cfg.deepspeed.micro_batch_size
        train_items = _with_reference(train_pairs, reference_logprobs(ref_engine, train_pairs, cfg.deepspeed, micro))
        eval_items = (
            _with_reference(eval_pairs, reference_logprobs(ref_engine, eval_pairs, cfg.deepspeed, micro))
            if eval_pairs
            else []
        )
        del ref_engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        live_ref = None
    else:
        train_items, eval_items = [RefPair(p) for p in train_pairs], [RefPair(p) for p in eval_pairs]
        live_ref = ref_engine

    def make_engine(total_steps: int) -> ModelEngine:
        return ModelEngine.from_config(
            cfg.model.path,
            cfg.deepspeed,
            "causal_lm",
            lora=cfg.model.lora,
            total_steps=total_steps,
            tokenizer_path=cfg.model.tokenizer_path,
        )

    return run_training(
        DPOTask(cfg, live_ref),
        make_engine,
        train_items,
        eval_items,
        cfg.train,
        cfg.logging,
        cfg.deepspeed,
        cfg.model_dump(),
    )
