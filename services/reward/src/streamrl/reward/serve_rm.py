"""``streamrl serve-rm``: serve a local reward model over HTTP with the OpenRLHF JSON protocol.

    POST /get_reward (or /)  {"query": [...], "prompts": [...], "labels": [...]}
                          -> {"rewards": [...], "scores": [...], "extra_logs": {}}
    GET  /health          -> {"status": "ok", "model": ...}

Every endpoint needs ``Authorization: Bearer <token>``, the token read from the environment
variable ``token_env`` (401 otherwise). Queries of concurrent requests are micro-batched into
shared forward passes (``batcher.MicroBatcher``); the forward runs in a worker thread. Scores are
``sigmoid(reward)``. Usage::

    STREAMRL_RM_TOKEN=... streamrl serve-rm --model_path=/models/rm --port=5000 [--field=value ...]
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from streamrl.common import aio
from streamrl.common.config import apply_overrides, validate
from streamrl.common.config_docs import config_help, field_docs
from streamrl.common.errors import ConfigError
from streamrl.common.redact import redact
from streamrl.reward.batcher import MicroBatcher
from streamrl.reward.config import ServeRmConfig
from streamrl.reward.scorers.model import LocalRewardModel, reward_to_score

logger = logging.getLogger(__name__)

ScoreTexts = Callable[[list[str]], list[float]]


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def create_app(score_texts: ScoreTexts, token: str, config: ServeRmConfig) -> web.Application:
    """The aiohttp application around a blocking ``score_texts(texts) -> rewards`` function."""
    if not token:
        raise ValueError("serve-rm needs a non-empty bearer token")
    expected = f"Bearer {token}".encode()

    async def score_batch(texts: list[str]) -> list[float]:
        return await asyncio.to_thread(score_texts, texts)

    batcher: MicroBatcher[str, float] = MicroBatcher(
        score_batch,
        config.max_batch_size,
        config.max_wait_ms,
        split_on=lambda e: isinstance(e, ValueError),
    )

    @web.middleware
    async def auth(
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> Any:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return _json_error(401, "missing or wrong bearer token")
        return await handler(request)

    async def get_reward(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _json_error(400, "body is not JSON")
        queries = body.get("query") if isinstance(body, dict) else None
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            return _json_error(400, "'query' must be a list of strings")
        if len(queries) > config.max_request_samples:
            return _json_error(
                413,
                f"{len(queries)} queries > max_request_samples={config.max_request_samples}",
            )
        try:
            rewards = await asyncio.gather(*(batcher.submit(q) for q in queries))
        except ValueError as e:
            return _json_error(400, str(e))
        return web.json_response(
            {
                "rewards": rewards,
                "scores": [reward_to_score(r) for r in rewards],
                "extra_logs": {},
            }
        )

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": os.path.basename(config.model_path.rstrip("/"))})

    async def on_cleanup(app: web.Application) -> None:
        await batcher.close()

    app = web.Application(middlewares=[auth], client_max_size=64 * 1024**2)
    app.router.add_post("/get_reward", get_reward)
    app.router.add_post("/", get_reward)
    app.router.add_get("/health", health)
    app.on_cleanup.append(on_cleanup)
    return app


async def serve(config: ServeRmConfig, token: str) -> None:
    """Load the model, serve until SIGTERM/SIGINT."""
    model = LocalRewardModel(
        config.model_path,
        architecture=config.architecture,
        value_head_prefix=config.value_head_prefix,
        batch_size=config.batch_size,
        max_length=config.max_length,
        device=config.device,
        dtype=config.dtype,
        normalize=config.normalize,
    )
    runner = web.AppRunner(create_app(model.score_texts, token, config), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"serve-rm: {config.model_path} listening on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def serve_rm_main(argv: list[str]) -> int:
    """Entry point of ``streamrl serve-rm --field=value ...``; returns the exit code."""
    if any(a in ("-h", "--help") for a in argv):
        print(f"{__doc__}\nconfig fields (--field=value):\n{config_help(field_docs(ServeRmConfig))}")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = validate(
            ServeRmConfig,
            apply_overrides({}, argv, env={}),
            source="serve-rm arguments",
        )
    except ConfigError as e:
        print(f"serve-rm: {e}", file=sys.stderr)
        return 2
    token = os.environ.get(config.token_env, "")
    if not token:
        print(
            f"serve-rm: set the bearer token in the environment variable {config.token_env}",
            file=sys.stderr,
        )
        return 2
    logger.info("serve-rm config: %s", json.dumps(redact(config.model_dump(mode="json"))))
    aio.run(serve(config, token))
    return 0


if __name__ == "__main__":
    sys.exit(serve_rm_main(sys.argv[1:]))
