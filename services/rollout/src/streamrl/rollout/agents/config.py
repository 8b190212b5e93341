"""AgentEndpointConfig: the ``[rollout.agent]`` section - the OpenAI-compatible endpoint for agents (torch-free)."""

from __future__ import annotations

import os

from pydantic import Field

from streamrl.common.config import BaseConfig


class AgentEndpointConfig(BaseConfig):
    """An OpenAI-compatible HTTP endpoint on the rollout worker: each sample of a prompt becomes a
    conversation that an external agent program drives (:mod:`streamrl.rollout.agents.openai_server`,
    docs/agents.md). The run's sampling (``coordinator.sampling``) applies to every request."""

    host: str = "127.0.0.1"
    """Interface to listen on (``0.0.0.0`` to serve agents on other machines)."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port; 0 = a free port (logged at start)."""
    token_env: str = Field("STREAMRL_AGENT_TOKEN", min_length=1)
    """Environment variable holding the bearer token agents must send (``Authorization: Bearer ...``);
    the worker refuses to start when it is unset or empty."""
    idle_timeout_s: float = Field(300.0, gt=0)
    """A conversation with no request for this long is dropped (logged) and its sample offered to
    the next agent that asks for a task (s)."""
    max_tokens: int = Field(1024, ge=1)
    """Tokens after the first request's prompt per conversation at most, the model's and the
    agent's; ``rollout.engine.max_model_len`` bounds prompt + conversation as well."""
    task_wait_s: float = Field(30.0, ge=0)
    """Longest time a request for a task waits for one before it is answered 204 (s); an agent may
    ask for less (``wait_s``)."""


def agent_token(config: AgentEndpointConfig) -> str:
    """The bearer token from ``$token_env``; ValueError naming the variable when it is unset or empty."""
    token = os.environ.get(config.token_env, "").strip()
    if not token:
        raise ValueError(
            f"rollout.agent: set the bearer token agents must send in ${config.token_env} "
            "(rollout.agent.token_env names the variable)"
        )
    return token
