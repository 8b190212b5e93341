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
    version_wait_s: float = Field(300.0, gt=0)
    """How long a prompt issued at a newer policy version waits for those weights to be published (s)."""
