"""RolloutConfig: the ``[rollout]`` section of a recipe (torch-free)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from streamrl.common.config import BaseConfig
from streamrl.common.lifecycle import ServiceConfig
from streamrl.rollout.agents.config import AgentEndpointConfig
from streamrl.rollout.engines.config import EngineConfig


class EnvironmentConfig(BaseConfig):
    """A multi-turn environment: every sample becomes an episode of model turns and environment replies
    (:mod:`streamrl.rollout.environments.episode`). Sampling (``coordinator.sampling``) applies to each turn:
    ``max_new_tokens`` is a turn's limit."""

    path: str = Field(min_length=1)
    """The environment class: ``/path/env.py`` or ``pkg.module``, optionally ``:ClassName`` (default
    ``Environment``); e.g. ``streamrl.rollout.environments.calculator:CalculatorEnvironment``."""
    options: dict[str, Any] = {}
    """Keyword arguments of the class's constructor (one instance per episode)."""
    max_turns: int = Field(4, ge=1)
    """Model turns per episode at most (stop reason ``max_turns``)."""
    max_tokens: int = Field(1024, ge=1)
    """Tokens after the prompt per episode at most, the model's and the environment's (stop reason
    ``max_tokens``); the engine's ``max_model_len`` bounds prompt + episode as well."""
    step_timeout_s: float = Field(60.0, gt=0)
    """Deadline of one ``reset`` or ``step`` call (s). A ``step`` that fails or overruns ends its episode
    (stop reason ``error``); a ``reset`` that does fails the prompt (retried, then dead-lettered)."""


class RolloutConfig(ServiceConfig):
    """A rollout worker: one generation engine serving prompts from the bus."""

    engine: EngineConfig
    environment: EnvironmentConfig | None = None
    """Multi-turn episodes with this environment; None = one completion per sample."""
    agent: AgentEndpointConfig | None = None
    """Serve an OpenAI-compatible endpoint: external agents drive every sample (docs/agents.md)."""
    weight_sync_timeout_s: float = Field(120.0, gt=0)
    """Deadline of one weight update; a miss is a loud WeightSyncError (the prompt is retried)."""
    version_wait_s: float = Field(1800.0, gt=0)
    """How long a prompt that asks for a newer policy version waits for those weights (s): prompts are
    issued ahead (coordinator.prefetch_steps), so this must exceed a learner step."""

    @model_validator(mode="after")
    def _one_driver(self) -> RolloutConfig:
        if self.agent is not None and self.environment is not None:
            raise ValueError("rollout.agent and rollout.environment exclude each other: agents drive the samples")
        return self
