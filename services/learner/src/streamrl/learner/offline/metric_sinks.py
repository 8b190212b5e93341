"""Where training curves go: metrics.jsonl always, TensorBoard and Weights & Biases when configured.

Optional sinks are null objects rather than ``if enabled:`` branches: W&B not installed or no
project set gives :class:`NullSink`. Only rank 0 writes; other ranks get a NullSink.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

from streamrl.learner.offline.config import LoggingConfig

log = logging.getLogger(__name__)


class MetricSink(Protocol):
    """Receives ``{name: value}`` scalars for one step."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Drops everything."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object per call (``{"step": s, **metrics}``) appended to a file."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """TensorBoard event files."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run."""

    def __init__(self, project: str, name: str, config: dict[str, Any]) -> None:
        import wandb

        self._run = wandb.init(project=project, name=name, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class FanOut:
    """Sends every call to several sinks."""

    def __init__(self, sinks: list[MetricSink]) -> None:
        self._sinks = sinks

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self._sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def _wandb_sink(cfg: LoggingConfig, run_dir: Path, config: dict[str, Any]) -> MetricSink:
    if cfg.wandb_project is None:
        return NullSink()
    try:
        import wandb  # noqa: F401
    except ImportError:
        log.warning("logging.wandb_project is set but wandb is not installed: W&B logging is off")
        return NullSink()
    return WandbSink(cfg.wandb_project, cfg.wandb_run_name or run_dir.name, config)


def build_sink(cfg: LoggingConfig, run_dir: Path, config: dict[str, Any], is_rank0: bool) -> MetricSink:
    """The sinks of this process: all configured ones on rank 0, nothing elsewhere."""
    if not is_rank0:
        return NullSink()
    sinks: list[MetricSink] = [JsonlSink(run_dir / "metrics.jsonl"), _wandb_sink(cfg, run_dir, config)]
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    return FanOut(sinks)
