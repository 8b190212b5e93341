"""The OpenAI-compatible HTTP endpoint agents talk to (aiohttp), over :class:`AgentGateway`.

Routes (every one needs ``Authorization: Bearer <token>``, the token read from the environment
variable ``rollout.agent.token_env``; docs/agents.md has examples)::

    POST /v1/streamrl/episodes                      take a task -> 200 {id, base_url, prompt, label, ...}
                                                    or 204 when none came within wait_s
    POST /v1/streamrl/episodes/{id}/v1/chat/completions   the conversation's requests (base_url)
    POST /v1/streamrl/episodes/{id}/v1/completions
    POST /v1/chat/completions, /v1/completions      the same, the id in the X-Streamrl-Episode header
    POST /v1/streamrl/episodes/{id}/reward          {reward, turn_rewards?, info?}: the conversation becomes a trajectory
    DELETE /v1/streamrl/episodes/{id}               give the task back (offered again)
    GET  /v1/models

A chat request's messages are rendered with the tokenizer's chat template (``add_generation_prompt``,
``tools`` passed along); a completion request's ``prompt`` is taken as it is (no BOS added). The
run's sampling applies: ``temperature`` / ``top_p`` other than the run's, ``n`` > 1, ``stream``,
``echo`` and ``top_logprobs`` are refused (400) rather than silently changed; ``max_tokens`` /
``max_completion_tokens`` (at most the run's ``max_new_tokens``) and ``stop`` are honoured. The
reply's text keeps special tokens except a final end-of-sequence token, so sending it back as the
assistant message extends the conversation exactly. ``logprobs`` returns the behaviour log-prob of
every generated token, the final end-of-sequence token included (aligned with ``token_ids``);
``return_token_ids`` (extra body) adds ``prompt_token_ids`` (the whole prompt the engine saw) and
the choice's ``token_ids``. Errors are OpenAI-shaped: ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from jinja2 import TemplateError

from streamrl.common.aio import cancel_and_wait
from streamrl.common.errors import RetryableError
from streamrl.rollout.agents.config import AgentEndpointConfig
from streamrl.rollout.agents.conversation import ContextExhaustedError, HistoryRewrittenError
from streamrl.rollout.agents.gateway import AgentGateway, ConversationBusyError, Live, Reply, UnknownConversationError
from streamrl.rollout.engines.engine import Engine

logger = logging.getLogger(__name__)
EPISODE_HEADER = "X-Streamrl-Episode"
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]
"""(messages, tools) -> the chat template's text with the generation prompt."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BadRequestError(ValueError):
    """A request the endpoint does not serve (400)."""


def _error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


class OpenAIServer:
    """The routes of the module docstring, bound to one gateway."""

    def __init__(
        self,
        gateway: AgentGateway,
        render: Render,
        token: str,
        model_name: str,
        eos_ids: set[int],
    ) -> None:
        self.gateway = gateway
        self.render = render
        self.token = token.encode()
        self.model_name = model_name
        self.eos_ids = eos_ids
        """Special token ids: one that ends a reply (finish reason ``stop``) is left out of the reply's
        text, as the chat template adds the end of an assistant message itself."""

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth, self._errors])
        base = "/v1/streamrl/episodes/{episode}/v1"
        app.add_routes(
            [
                web.post("/v1/streamrl/episodes", self.take),
                web.post("/v1/streamrl/episodes/{episode}/reward", self.reward),
                web.delete("/v1/streamrl/episodes/{episode}", self.give_back),
                web.post(f"{base}/chat/completions", self.chat),
                web.post(f"{base}/completions", self.completion),
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completion),
                web.get("/v1/models", self.models),
            ]
        )
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token):
            return _error(401, "a valid bearer token is required (Authorization: Bearer ...)", "invalid_api_key")
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except UnknownConversationError as e:
            return _error(404, f"no live conversation {e.args[0]!r} (finished, timed out or given back)", "not_found")
        except ConversationBusyError as e:
            return _error(409, str(e), "conversation_busy")
        except HistoryRewrittenError as e:
            return _error(400, str(e), "history_rewritten")
        except ContextExhaustedError as e:
            return _error(400, str(e), "context_length_exceeded")
        except RetryableError as e:
            return _error(503, str(e), "unavailable")
        except ValueError as e:  # BadRequestError, a template that cannot render the messages, an empty prompt
            return _error(400, str(e), "invalid_request")

    async def take(self, request: web.Request) -> web.Response:
        body = await _json(request) if request.can_read_body else {}
        wait_s = min(_number(body, "wait_s", self.gateway.cfg.task_wait_s), self.gateway.cfg.task_wait_s)
        live = await self.gateway.take(max(0.0, wait_s))
        if live is None:
            return web.Response(status=204)
        item, index = live.slot.item, live.slot.index
        base_url = str(request.url.with_path(f"/v1/streamrl/episodes/{live.id}/v1").with_query(None))
        return web.json_response(
            {
                "id": live.id,
                "base_url": base_url,
                "group_id": item.id,
                "index": index,
                "group_size": item.sampling.n,
                "trajectory_id": f"{item.id}/{index}",
                "prompt": item.prompt_text,
                "label": item.label,
                "metadata": item.metadata,
                "is_eval": item.is_eval,
                "policy_version": item.policy_version,
                "model": self.model_name,
            }
        )

    async def reward(self, request: web.Request) -> web.Response:
        live = self.gateway.get(request.match_info["episode"])
        body = await _json(request)
        reward = _number(body, "reward", None)
        info = body.get("info", {})
        if not isinstance(info, dict):
            raise BadRequestError("info must be an object")
        turn_rewards = body.get("turn_rewards")
        if turn_rewards is not None:
            if not isinstance(turn_rewards, list):
                raise BadRequestError(f"turn_rewards must be a list of numbers, got {turn_rewards!r}")
            turn_rewards = [_number({"turn_rewards[]": r}, "turn_rewards[]", None) for r in turn_rewards]
        episode = self.gateway.finish(live, reward, info, turn_rewards)
        item = live.slot.item
        return web.json_response(
            {
                "trajectory_id": f"{item.id}/{live.slot.index}",
                "num_turns": len(episode.turns),
                "num_tokens": len(episode.token_ids),
                "num_model_tokens": episode.num_model_tokens,
            }
        )

    async def give_back(self, request: web.Request) -> web.Response:
        live = self.gateway.get(request.match_info["episode"])
        self.gateway.abandon(live, "given back by the agent")
        return web.json_response({"id": live.id, "given_back": True})

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "streamrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def chat(self, request: web.Request) -> web.Response:
        live = self._conversation(request)
        body = await _json(request)
        self._check_sampling(live, body)
        top = body.get("top_logprobs")
        if top not in (None, 0):
            raise BadRequestError("top_logprobs is not supported: only the sampled token's log-prob is recorded")
        try:
            rendered = self.render(_messages(body), body.get("tools"))
        except TemplateError as e:
            raise BadRequestError(f"the chat template cannot render these messages: {e}") from e
        max_new = body.get("max_completion_tokens", body.get("max_tokens"))
        reply = await self.gateway.reply(live, rendered, _max_tokens(max_new), _stop(body))
        content = self._content(reply)
        logprobs = None
        if body.get("logprobs"):
            logprobs = {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(self._token_texts(reply.sample.token_ids), reply.sample.logprobs, strict=True)
                ]
            }
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": reply.sample.finish_reason,
            "logprobs": logprobs,
        }
        return web.json_response(self._response("chat.completion", live, reply, choice, body))

    async def completion(self, request: web.Request) -> web.Response:
        live = self._conversation(request)
        body = await _json(request)
        self._check_sampling(live, body)
        if body.get("echo"):
            raise BadRequestError("echo is not supported")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequestError("prompt must be one string")
        reply = await self.gateway.reply(live, prompt, _max_tokens(body.get("max_tokens")), _stop(body))
        text = self._content(reply)
        logprobs = None
        if body.get("logprobs") is not None:
            tokens = self._token_texts(reply.sample.token_ids)
            offsets = [len(prompt) + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            logprobs = {
                "tokens": tokens,
                "token_logprobs": reply.sample.logprobs,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "finish_reason": reply.sample.finish_reason,
            "logprobs": logprobs,
        }
        return web.json_response(self._response("text_completion", live, reply, choice, body))

    def _conversation(self, request: web.Request) -> Live:
        cid = request.match_info.get("episode") or request.headers.get(EPISODE_HEADER)
        if not cid:
            raise BadRequestError(f"which conversation? use the base_url of a task or the {EPISODE_HEADER} header")
        return self.gateway.get(cid)

    def _check_sampling(self, live: Live, body: dict[str, Any]) -> None:
        if not isinstance(body.get("model", ""), str):
            raise BadRequestError("model must be a string")
        if body.get("stream"):
            raise BadRequestError("stream is not supported")
        if body.get("n") not in (None, 1):
            raise BadRequestError("n must be 1: a conversation is one line of samples")
        run = live.slot.item.sampling
        for name, value in (("temperature", run.temperature), ("top_p", run.top_p)):
            given = body.get(name)
            if given is not None and not (isinstance(given, int | float) and math.isclose(given, value)):
                raise BadRequestError(
                    f"{name}={given!r} differs from the run's {value} (coordinator.sampling): the "
                    "behaviour log-probs must come from the distribution the learner assumes"
                )

    def _content(self, reply: Reply) -> str:
        """The reply's text as returned to the agent: without a final end-of-sequence token."""
        ids = reply.sample.token_ids
        if ids and reply.sample.finish_reason == "stop" and ids[-1] in self.eos_ids:
            return self.gateway.decode(ids[:-1])
        return reply.text

    def _token_texts(self, ids: list[int]) -> list[str]:
        return [self.gateway.decode([t]) for t in ids]

    def _response(
        self, kind: str, live: Live, reply: Reply, choice: dict[str, Any], body: dict[str, Any]
    ) -> dict[str, Any]:
        sample, prompt_ids = reply.sample, reply.plan.prompt_ids
        out: dict[str, Any] = {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(sample.token_ids),
                "total_tokens": len(prompt_ids) + len(sample.token_ids),
            },
            "policy_version": sample.version_start,
            "episode": live.id,
        }
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = sample.token_ids
        return out


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise BadRequestError(f"the body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object")
    return body


def _number(body: dict[str, Any], name: str, default: float | None) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _max_tokens(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequestError(f"max_tokens must be an integer >= 1, got {value!r}")
    return value


def _stop(body: dict[str, Any]) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequestError("stop must be a string or a list of non-empty strings")
    return stops


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages with text content (a list of text parts is joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequestError("every message needs a role")
        content = m.get("content") or ""
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadRequestError("only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise BadRequestError("message content must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out


@asynccontextmanager
async def serve(server: OpenAIServer, gateway: AgentGateway, config: AgentEndpointConfig) -> AsyncIterator[str]:
    """Serve ``server`` on ``config.host:port`` and reap idle conversations; yields the base URL."""
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}/v1"
    logger.info("agent endpoint at %s (token from $%s)", url, config.token_env)
    reaper = asyncio.create_task(gateway.reap_forever())
    try:
        yield url
    finally:
        await cancel_and_wait([reaper])
        await runner.cleanup()


def build(
    engine: Engine, tokenizer: Any, agent: AgentEndpointConfig, max_model_len: int, model_name: str, token: str
) -> tuple[OpenAIServer, AgentGateway]:
    """The gateway and the server over ``engine`` with ``tokenizer`` (a Hugging Face tokenizer with a
    chat template for the chat route)."""

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        if tokenizer.chat_template is None:
            raise BadRequestError("the model's tokenizer has no chat template: use /v1/completions")
        return str(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True))

    gateway = AgentGateway(engine, decode, encode, agent, max_model_len)
    return OpenAIServer(gateway, render, token, model_name, set(tokenizer.all_special_ids)), gateway
