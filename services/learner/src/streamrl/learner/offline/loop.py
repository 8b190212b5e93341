"""The training loop shared by the SFT, reward-model and DPO jobs.

A job supplies an :class:`OfflineTask` (how one micro-batch of its items becomes a loss, and how
evaluation sums become metrics) and lists of items (samples, packed rows or pairs). The loop does
the rest, identically for all three:

* data order: epoch ``e`` visits the items in ``permutation(seed, e)``; optimizer step ``b`` of the
  epoch takes the ``b``-th slice of ``micro_batch_size * grad_accum * world_size`` items, and each
  rank takes its own contiguous part. The order depends only on (seed, epoch), so a resumed run
  sees exactly the batches an uninterrupted run would (the incomplete last batch is dropped).
* checkpoints every ``save_every`` steps and at the end, with the data position ``(epoch, batch)``
  in the client state; on start, ``run_dir/checkpoints`` is resumed from if it holds one.
* evaluation every ``eval_every`` steps and at the end (sums all-reduced over ranks), best-model
  export to ``run_dir/best`` when ``best_metric`` improves, final export to ``run_dir/final``.
* curves to metrics.jsonl / TensorBoard / W&B and a progress bar on rank 0.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm import tqdm

from streamrl.learner.checkpoint_retention import prune_checkpoints
from streamrl.learner.distributed import init_distributed
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.engine import ModelEngine
from streamrl.learner.offline.config import LoggingConfig, TrainConfig
from streamrl.learner.offline.metric_sinks import MetricSink, build_sink

_EXPORT_FALLBACK_ITEMS = 256


class OfflineTask(Protocol):
    """What a job plugs into the loop."""

    default_best_metric: str
    """Eval metric that picks the best checkpoint unless ``train.best_metric`` says otherwise."""

    def train_loss(self, engine: ModelEngine, items: Sequence[Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch (to back-propagate) and scalars to log (averaged over micro-batches)."""
        ...

    def eval_sums(self, engine: ModelEngine, items: Sequence[Any]) -> dict[str, float]:
        """Additive evaluation statistics of one micro-batch (summed over batches and ranks)."""
        ...

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Metrics from the summed statistics."""
        ...

    def export_config(self, metrics: dict[str, float]) -> dict[str, Any]:
        """Entries added to the exported model's config (e.g. reward statistics)."""
        ...


@dataclass
class LoopResult:
    """What a finished run reports."""

    history: list[dict[str, float]] = field(default_factory=list)
    """Training scalars of every optimizer step taken by this process (``step`` included)."""
    evals: list[dict[str, float]] = field(default_factory=list)
    """Every evaluation (``step`` included)."""
    best: dict[str, float] | None = None
    """The best evaluation so far (``step`` and ``value``), over the whole run including before a resume."""
    final_dir: Path | None = None
    """Hugging Face export of the final model."""


def epoch_order(n_items: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits the items."""
    return np.random.default_rng([seed, epoch]).permutation(n_items)


def _all_reduce(values: list[float], engine: ModelEngine, op: str = "sum") -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=engine.device)
    torch.distributed.all_reduce(t)
    if op == "mean":
        t /= engine.world_size
    return t.tolist()


def rank_batches(items: Sequence[Any], rank: int, world: int, micro_batch: int) -> list[tuple[list[Any], bool]]:
    """This rank's share of ``items`` in micro-batches, as ``(batch, real)``.

    Every rank gets the same number of batches (ZeRO-3 forwards are collective); a rank with
    fewer items pads with copies of the first items, marked ``real=False`` (to be ignored).
    """
    mine = list(items[rank::world])
    n_batches = math.ceil(math.ceil(len(items) / world) / micro_batch)
    out = []
    for b in range(n_batches):
        batch = mine[b * micro_batch : (b + 1) * micro_batch]
        out.append((batch, True) if batch else (list(items[:micro_batch]), False))
    return out


def evaluate(task: OfflineTask, engine: ModelEngine, items: Sequence[Any], micro_batch: int) -> dict[str, float]:
    """Metrics of ``task`` over ``items`` (sharded over ranks, sums all-reduced)."""
    sums: dict[str, float] = {}
    engine.train(False)
    with torch.no_grad():
        for batch, real in rank_batches(items, engine.rank, engine.world_size, micro_batch):
            batch_sums = task.eval_sums(engine, batch)
            if real:
                for key, value in batch_sums.items():
                    sums[key] = sums.get(key, 0.0) + value
    engine.train(True)
    keys = _all_reduce_keys(sums, engine)
    totals = _all_reduce([sums.get(k, 0.0) for k in keys], engine)
    return task.eval_metrics(dict(zip(keys, totals, strict=True)))


def _all_reduce_keys(sums: dict[str, float], engine: ModelEngine) -> list[str]:
    """Every rank must reduce the same keys, also a rank whose eval shard is empty."""
    gathered: list[list[str] | None] = [None] * engine.world_size
    torch.distributed.all_gather_object(gathered, sorted(sums))
    return sorted({k for keys in gathered for k in (keys or [])})


class _Run:
    """State of one training run (kept in one place so that checkpoints capture all of it)."""

    def __init__(self, cfg: TrainConfig, engine: ModelEngine, task: OfflineTask, sink: MetricSink) -> None:
        self.cfg = cfg
        self.engine = engine
        self.task = task
        self.sink = sink
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.epoch = 0
        self.batch = 0
        self.best: dict[str, float] | None = None
        self.result = LoopResult()
        self.best_metric = cfg.best_metric or task.default_best_metric
        self.best_mode = cfg.best_mode or ("min" if self.best_metric == "loss" else "max")

    def client_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch, "best": self.best}

    def restore(self) -> None:
        if not self.cfg.resume:
            return
        state = self.engine.load_checkpoint(self.ckpt_dir)
        if state is not None:
            self.epoch, self.batch, self.best = state["epoch"], state["batch"], state["best"]
            self.result.best = self.best

    def save(self) -> None:
        self.engine.save_checkpoint(self.ckpt_dir, self.client_state())
        if self.engine.rank == 0:
            prune_checkpoints(self.ckpt_dir, self.cfg.keep_last)

    def eval_and_track(self, items: Sequence[Any], micro_batch: int) -> dict[str, float]:
        step = self.engine.global_steps
        metrics = evaluate(self.task, self.engine, items, micro_batch)
        self.sink.log({f"eval/{k}": v for k, v in metrics.items()}, step)
        self.result.evals.append({"step": step, **metrics})
        value = metrics[self.best_metric]
        better = self.best is None or (
            value < self.best["value"] if self.best_mode == "min" else value > self.best["value"]
        )
        if better and math.isfinite(value):
            self.best = {"step": step, "value": value}
            self.result.best = self.best
            if self.cfg.save_best:
                best_dir = self.run_dir / "best"
                self.engine.export_hf(best_dir, self.task.export_config(metrics))
                if self.engine.rank == 0:
                    (best_dir / "best.json").write_text(json.dumps({"metric": self.best_metric, **self.best}))
        return metrics


def run_training(
    task: OfflineTask,
    make_engine: Callable[[int], ModelEngine],
    train_items: Sequence[Any],
    eval_items: Sequence[Any],
    cfg: TrainConfig,
    logging_cfg: LoggingConfig,
    ds_cfg: DeepSpeedConfig,
    full_config: dict[str, Any],
) -> LoopResult:
    """Train ``task`` on ``train_items``; ``make_engine(total_steps)`` builds the engine once the size is known."""
    micro_batch, grad_accum, seed = ds_cfg.micro_batch_size, ds_cfg.grad_accum, ds_cfg.seed
    init_distributed()
    world = torch.distributed.get_world_size()
    per_rank = micro_batch * grad_accum
    global_batch = per_rank * world
    steps_per_epoch = len(train_items) // global_batch
    if steps_per_epoch == 0:
        raise ValueError(
            f"{len(train_items)} training items are fewer than one global batch "
            f"({micro_batch} micro x {grad_accum} accumulation x {world} ranks)"
        )
    total = cfg.epochs * steps_per_epoch if cfg.max_steps is None else min(cfg.max_steps, cfg.epochs * steps_per_epoch)
    engine = make_engine(total)
    run_dir = Path(cfg.run_dir)
    sink = build_sink(logging_cfg, run_dir, full_config, engine.rank == 0)
    run = _Run(cfg, engine, task, sink)
    run.restore()
    bar = tqdm(total=total, initial=engine.global_steps, disable=not (logging_cfg.progress and engine.rank == 0))
    try:
        while engine.global_steps < total:
            order = epoch_order(len(train_items), seed, run.epoch)
            start = run.batch * global_batch + engine.rank * per_rank
            mine = [train_items[i] for i in order[start : start + per_rank]]
            _train_step(run, mine, micro_batch, bar)
            run.batch += 1
            if run.batch == steps_per_epoch:
                run.epoch, run.batch = run.epoch + 1, 0
            step = engine.global_steps
            if eval_items and cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                run.eval_and_track(eval_items, micro_batch)
            if cfg.save_every and step % cfg.save_every == 0 and step < total:
                run.save()
        final_metrics = run.eval_and_track(eval_items, micro_batch) if eval_items else {}
        run.save()
        if cfg.export:
            if not final_metrics:  # e.g. reward statistics for the export config
                final_metrics = evaluate(task, engine, train_items[:_EXPORT_FALLBACK_ITEMS], micro_batch)
            run.result.final_dir = engine.export_hf(run_dir / "final", task.export_config(final_metrics))
    finally:
        bar.close()
        sink.close()
    return run.result


def _train_step(run: _Run, items: list[Any], micro_batch: int, bar: tqdm) -> None:
    engine = run.engine
    t0 = time.perf_counter()
    lr = engine.lr
    totals: dict[str, float] = {}
    n_micro = 0
    for start in range(0, len(items), micro_batch):
        loss, scalars = run.task.train_loss(engine, items[start : start + micro_batch])
        engine.backward(loss)
        engine.step()
        n_micro += 1
        for key, value in {"loss": float(loss.detach()), **scalars}.items():
            totals[key] = totals.get(key, 0.0) + value
    keys = sorted(totals)
    means = _all_reduce([totals[k] / n_micro for k in keys], engine, op="mean")
    metrics = dict(zip(keys, means, strict=True))
    metrics.update(lr=lr, step_time_s=time.perf_counter() - t0)
    if engine.grad_norm is not None:
        metrics["grad_norm"] = engine.grad_norm
    step = engine.global_steps
    run.sink.log({f"train/{k}": v for k, v in metrics.items()}, step)
    run.result.history.append({"step": step, **metrics})
    bar.update(1)
    bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{lr:.2e}")
