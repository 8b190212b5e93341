"""Scorers: one module per kind (function, http, model) behind the ``Scorer`` protocol."""

from __future__ import annotations

from collections.abc import Callable

from streamrl.reward.config import (
    FunctionScorerConfig,
    HttpScorerConfig,
    ModelScorerConfig,
    ScorerConfig,
)
from streamrl.reward.scorers.base import PermanentScorerError, Scorer, ScorerError, ScorerResult
from streamrl.reward.scorers.function import FunctionScorer
from streamrl.reward.scorers.http import HttpScorer
from streamrl.reward.scorers.model import ModelScorer

__all__ = [
    "FunctionScorer",
    "HttpScorer",
    "ModelScorer",
    "PermanentScorerError",
    "Scorer",
    "ScorerError",
    "ScorerResult",
    "build_scorer",
]


def build_scorer(config: ScorerConfig, on_exhausted: Callable[[str], None] | None = None) -> Scorer:
    """Construct the scorer a config section describes (a model scorer loads its model here).
    ``on_exhausted``: told why when a function or model scorer's threads are all held by calls that timed out."""
    if isinstance(config, FunctionScorerConfig):
        return FunctionScorer(config, on_exhausted=on_exhausted)
    if isinstance(config, HttpScorerConfig):
        return HttpScorer(config)
    if isinstance(config, ModelScorerConfig):
        return ModelScorer(config, on_exhausted=on_exhausted)
    raise AssertionError(f"unknown scorer config {type(config).__name__}")
