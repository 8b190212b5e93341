"""Supervised fine-tuning job: next-token loss on response (assistant) tokens, optionally packed.

Loss: token mean over the response tokens of each micro-batch (algorithms.md 3.10). Eval metric:
``loss`` (token mean over the whole eval set).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from streamrl.learner.data import build_sft_samples, train_eval_records
from streamrl.learner.engine import ModelEngine, load_tokenizer
from streamrl.learner.logprobs import IGNORE_INDEX, head_token_logprobs, token_logprobs
from streamrl.learner.offline_config import SFTConfig
from streamrl.learner.offline_loop import LoopResult, run_training
from streamrl.learner.offline_losses import masked_nll
from streamrl.learner.packing import Row, Sample, collate, pack_samples, sample_row


def response_logprobs(
    engine: ModelEngine, rows: Sequence[Row], pad_id: int, packed: bool, chunked_head: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the next-token targets of ``rows`` and the mask of positions that have one."""
    batch = collate(list(rows), pad_id, packed)
    targets = batch.pop("targets").to(engine.device)
    model = engine.module
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    head = base.get_output_embeddings()
    if chunked_head and head is not None and hasattr(base, "model"):
        # decoder body, then the output head chunk by chunk: the full [tokens, vocab] logits never exist
        hidden = base.model(**{k: v.to(engine.device) for k, v in batch.items()}).last_hidden_state
        return head_token_logprobs(hidden, head, targets), targets != IGNORE_INDEX
    logits = engine(**batch).logits
    return token_logprobs(logits, targets), targets != IGNORE_INDEX


class SFTTask:
    """The SFT loss and eval statistics over rows (single samples or packed)."""

    default_best_metric = "loss"

    def __init__(self, pad_id: int, packed: bool, chunked_head: bool = True) -> None:
        self.pad_id = pad_id
        self.packed = packed
        self.chunked_head = chunked_head

    def train_loss(self, engine: ModelEngine, items: Sequence[Row]) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs, mask = response_logprobs(engine, items, self.pad_id, self.packed, self.chunked_head)
        return masked_nll(logprobs, mask), {"tokens": float(mask.sum())}

    def eval_sums(self, engine: ModelEngine, items: Sequence[Row]) -> dict[str, float]:
        logprobs, mask = response_logprobs(engine, items, self.pad_id, self.packed)
        return {"nll": float(-(logprobs * mask).sum()), "tokens": float(mask.sum())}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["nll"] / max(sums["tokens"], 1.0)}

    def export_config(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {}


def to_rows(samples: list[Sample], cfg: SFTConfig, pad_id: int) -> list[Row]:
    """Model rows: packed into ``data.max_len`` tokens, or one sample each."""
    if cfg.packing:
        return pack_samples(samples, cfg.data.max_len, pad_id)
    return [sample_row(s) for s in samples]


def run_sft(cfg: SFTConfig) -> LoopResult:
    """Run an SFT job end to end (resuming from ``train.run_dir`` when it holds a checkpoint)."""
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    pad_id = int(tokenizer.pad_token_id)
    train_records, eval_records = train_eval_records(cfg.data, cfg.deepspeed.seed)
    train_rows = to_rows(build_sft_samples(train_records, tokenizer, cfg.data), cfg, pad_id)
    eval_rows = to_rows(build_sft_samples(eval_records, tokenizer, cfg.data), cfg, pad_id) if eval_records else []

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
        SFTTask(pad_id, cfg.packing),
        make_engine,
        train_rows,
        eval_rows,
        cfg.train,
        cfg.logging,
        cfg.deepspeed,
        cfg.model_dump(),
    )
