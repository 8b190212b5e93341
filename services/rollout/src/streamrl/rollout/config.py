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


class WeightRelayConfig(BaseConfig):
    """This worker's place in the weight relay (``learner.weights_transport = "relay"``): it serves the verified
    chunks of the version it holds to the workers after it (:mod:`streamrl.rollout.weights.relay_sources`)."""

    host: str = "127.0.0.1"
    """Interface the worker's relay node binds (``0.0.0.0`` for workers on several hosts)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the relay node (0 = a free port); advertised in the worker's heartbeat."""
    advertise_host: str | None = None
    """Host name other workers reach this node at (default: ``host``; this machine's name when it is 0.0.0.0)."""
    fanout: int = Field(1, ge=1)
    """Workers each node serves at once: 1 = a chain (the learner sends each version once; measured best,
    docs/scaling.md), k = a k-ary tree, >= the number of workers = every worker from the learner."""
    stall_s: float | None = Field(None, gt=0)
    """An upstream that sends nothing for this long (s) is dropped and the next one (finally the learner) takes
    over from the first missing chunk; must be below ``weight_sync_timeout_s`` to leave room for that. None = a
    third of ``weight_sync_timeout_s``, at most 5 s."""


class RolloutConfig(ServiceConfig):
    """A rollout worker: one generation engine serving prompts from the bus."""

    engine: EngineConfig
    environment: EnvironmentConfig | None = None
    """Multi-turn episodes with this environment; None = one completion per sample."""
    agent: AgentEndpointConfig | None = None
    """Serve an OpenAI-compatible endpoint: external agents drive every sample (docs/agents.md)."""
    weight_sync_timeout_s: float = Field(120.0, gt=0)
    """Deadline of one weight update; a miss is a loud WeightSyncError (the prompt is retried)."""
    weights_relay: WeightRelayConfig = WeightRelayConfig()
    """The worker's relay node, used when the learner publishes over ``relay``."""
    version_wait_s: float = Field(1800.0, gt=0)
    """How long a prompt that asks for a newer policy version waits for those weights (s): prompts are
    issued ahead (coordinator.prefetch_steps), so this must exceed a learner step."""

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.agent is not None and self.environment is not None:
            raise ValueError("rollout.agent and rollout.environment exclude each other: agents drive the samples")
        if self.weights_relay.stall_s is not None and self.weights_relay.stall_s >= self.weight_sync_timeout_s:
            raise ValueError(
                f"rollout.weights_relay.stall_s ({self.weights_relay.stall_s} s) must be below "
                f"rollout.weight_sync_timeout_s ({self.weight_sync_timeout_s} s): a stalled relay must be "
                "dropped in time to fetch from the next one"
            )
        return self

    @property
    def relay_stall_s(self) -> float:
        """``weights_relay.stall_s``, or its default from ``weight_sync_timeout_s``."""
        stall_s = self.weights_relay.stall_s
        return stall_s if stall_s is not None else min(5.0, self.weight_sync_timeout_s / 3)
