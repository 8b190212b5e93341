"""Supervised fine-tuning job: next-token loss on response (assistant) tokens, optionally packed.

Loss: token mean over the response tokens of each micro-batch (algorithms.md 3.10). Eval metric:
``loss`` (token mean over the whole eval set). The rows of a micro-batch run as one flat varlen
forward with a fused log-prob head (:mod:`streamrl.learner.lm_forward`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.engine import ModelEngine, load_tokenizer
from streamrl.learner.lm_forward import rows_logprobs, rows_nll
from streamrl.learner.offline.config import SFTConfig
from streamrl.learner.offline.data import build_sft_samples, train_eval_records
from streamrl.learner.offline.loop import LoopResult, run_training
from streamrl.learner.packing import Row, Sample, pack_samples, sample_row


class SFTTask:
    """The SFT loss and eval statistics over rows (single samples or packed), through the flat varlen
    forward and the log-prob head of :mod:`streamrl.learner.lm_forward` (fused unless ``cfg`` says not)."""

    default_best_metric = "loss"

    def __init__(self, cfg: DeepSpeedConfig) -> None:
        self.cfg = cfg

    def train_loss(self, engine: ModelEngine, items: Sequence[Row]) -> tuple[torch.Tensor, dict[str, float]]:
        loss, tokens = rows_nll(engine, items, self.cfg)
        return loss, {"tokens": float(tokens)}

    def eval_sums(self, engine: ModelEngine, items: Sequence[Row]) -> dict[str, float]:
        logprobs, mask = rows_logprobs(engine, items, self.cfg)
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
        SFTTask(cfg.deepspeed),
        make_engine,
        train_rows,
        eval_rows,
        cfg.train,
        cfg.logging,
        cfg.deepspeed,
        cfg.model_dump(),
    )
