"""The run's metrics reach Weights & Biases when coordinator.wandb_project is set (a stand-in for the
wandb package records what the writer calls), and a missing package is a config error."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from streamrl.coordinator.config import CoordinatorConfig
from streamrl.coordinator.metrics import MetricsWriter, read_metrics, wandb_run


class _Run:
    def __init__(self, **init: Any) -> None:
        self.init, self.logged, self.defined, self.finished = init, [], [], False

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.defined.append((name, step_metric))

    def log(self, row: dict[str, float]) -> None:
        self.logged.append(row)

    def finish(self) -> None:
        self.finished = True


def test_metrics_rows_go_to_wandb_by_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[_Run] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(_Run(**kw)) or runs[-1]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    writer = MetricsWriter(tmp_path, wandb=wandb_run("rl-project", "run-7", {"total_steps": 4}))
    writer.write(3, {"rollout/acc": 0.5, "coordinator/dead_reason": "HTTP 500", "coordinator/batch_samples": 16})
    writer.write(2, {"eval/acc": 0.25})  # an evaluation of an older version, finishing late
    writer.close()
    (run,) = runs
    assert run.init == {"project": "rl-project", "name": "run-7", "config": {"total_steps": 4}}
    assert ("*", "trainer/step") in run.defined
    assert run.logged == [
        {"rollout/acc": 0.5, "coordinator/batch_samples": 16.0, "trainer/step": 3},
        {"eval/acc": 0.25, "trainer/step": 2},
    ]
    assert run.finished
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [3, 2]  # the file is unchanged


def test_no_project_no_wandb_and_a_missing_package_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert wandb_run(None, "run", {}) is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValidationError, match=r"wandb_project is set but wandb is not installed: pip install"):
        CoordinatorConfig(dataset={"path": "x.jsonl", "tokenizer": "t"}, wandb_project="rl-project")
