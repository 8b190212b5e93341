"""RolloutConfig: the ``[rollout]`` section of a recipe (torch-free)."""

from __future__ import annotations

from pydantic import Field

from streamrl.common.lifecycle import ServiceConfig
from streamrl.rollout.engine_config import EngineConfig


class RolloutConfig(ServiceConfig):
    """A rollout worker: one generation engine serving prompts from the bus."""

    engine: EngineConfig
    weight_sync_timeout_s: float = Field(120.0, gt=0)
    """Deadline of one weight update; a miss is a loud WeightSyncError (the prompt is retried)."""
    version_wait_s: float = Field(1800.0, gt=0)
    """How long a prompt that asks for a newer policy version waits for those weights (s): prompts are
    issued ahead (coordinator.prefetch_steps), so this must exceed a learner step."""
