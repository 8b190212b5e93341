"""``streamrl rollout RECIPE [--rollout.field=value ...]``: run one rollout worker."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from streamrl.common.lifecycle import ServiceContext, service_main
from streamrl.rollout.agents.config import agent_token
from streamrl.rollout.config import RolloutConfig

if TYPE_CHECKING:
    from streamrl.rollout.engines.engine import Engine


async def _run(config: RolloutConfig, ctx: ServiceContext) -> None:
    from streamrl.rollout.engines.factory import build_engine
    from streamrl.rollout.environments.environment import load_environment
    from streamrl.rollout.environments.episode import EpisodeRunner
    from streamrl.rollout.service import RolloutService

    assert config.redis.url is not None  # service_main refuses to start without one
    ctx.metrics.watch_streams(config.redis.url, {"prompts": ctx.names.prompts})
    env = config.environment
    # before the engine: a wrong environment path fails in seconds, not after the model loads
    factory = None if env is None else load_environment(env.path, env.options)
    token = None if config.agent is None else agent_token(config.agent)
    engine = await asyncio.to_thread(build_engine, config.engine)
    episodes = None
    if env is not None and factory is not None:
        from streamrl.rollout.vision import load_expander

        tokenize = await asyncio.to_thread(_tokenizer, config)
        expand = await asyncio.to_thread(load_expander, config.engine.model, config.engine.trust_remote_code)
        episodes = EpisodeRunner(engine, factory, tokenize, env, config.engine.max_model_len, expand)
    if token is not None:
        await _run_with_agents(config, ctx, engine, token)
        return
    await RolloutService(config, ctx, engine, episodes).run()


async def _run_with_agents(config: RolloutConfig, ctx: ServiceContext, engine: Engine, token: str) -> None:
    """The worker with the OpenAI endpoint in front (``rollout.agent``): agents drive every sample."""
    from transformers import AutoTokenizer

    from streamrl.rollout.agents import openai_server
    from streamrl.rollout.service import RolloutService

    agent, cfg = config.agent, config.engine
    assert agent is not None
    tokenizer = await asyncio.to_thread(
        AutoTokenizer.from_pretrained, cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code
    )
    server, gateway = openai_server.build(engine, tokenizer, agent, cfg.max_model_len, cfg.model, token)
    async with openai_server.serve(server, gateway, agent):
        await RolloutService(config, ctx, engine, gateway).run()


def _tokenizer(config: RolloutConfig) -> Callable[[str], list[int]]:
    """The engine's tokenizer (the same folder it loads) as text -> ids, no special tokens added."""
    from transformers import AutoTokenizer

    engine = config.engine
    tokenizer = AutoTokenizer.from_pretrained(
        engine.tokenizer or engine.model, trust_remote_code=engine.trust_remote_code
    )
    return lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])


def main(argv: list[str] | None = None) -> int:
    return service_main("rollout", RolloutConfig, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
