"""Run metrics: one JSONL file, TensorBoard scalars, optionally a Weights & Biases run, and a PNG plot
of reward and accuracy per step."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Append ``{"step", "time", **metrics}`` lines to ``{run_dir}/metrics.jsonl``, to TensorBoard and,
    with ``wandb`` (an initialised W&B run: :func:`wandb_run`), to Weights & Biases."""

    def __init__(self, run_dir: str | Path, wandb: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        from tensorboard.summary import Writer

        self.tb = Writer(str(self.run_dir / "tensorboard"))
        self.wandb = wandb

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "time": round(time.time(), 3), **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        for name, value in scalars.items():
            self.tb.add_scalar(name, value, step)
        self.tb.flush()
        if self.wandb is not None and scalars:
            # rows of one step arrive apart (batch, learner step, evaluation): W&B merges them by step, and a
            # row for an older step (an evaluation finishing late) must not be dropped as out of order
            self.wandb.log({**scalars, "trainer/step": step})

    def close(self) -> None:
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def wandb_run(project: str | None, name: str, config: dict[str, Any]) -> Any:
    """A Weights & Biases run for ``project`` (None: no run), its x axis the training step."""
    if project is None:
        return None
    import wandb  # the config checked it is installed

    run = wandb.init(project=project, name=name, config=config)
    run.define_metric("trainer/step")
    run.define_metric("*", step_metric="trainer/step")
    return run


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def plot(run_dir: str | Path) -> Path | None:
    """Draw reward and accuracy per step into ``{run_dir}/progress.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name in ("rollout/reward_mean", "rollout/acc", "eval/acc"):
            if name in row:
                series.setdefault(name, []).append((row["step"], row[name]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if name == "eval/acc" else None, label=name)
    ax.set_xlabel("step (policy version)")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(run_dir) / "progress.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
