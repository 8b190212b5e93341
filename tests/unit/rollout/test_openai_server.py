"""The OpenAI endpoint for agents, driven by the official ``openai`` client over real HTTP.

The engine is a stand-in that answers a script with the chat tokenizer's ids and position-dependent
log-probs (so each check sees which context a reply came from); the tokenizer is the agent example's
character-level one with role tokens and a chat template (examples/agent/chat_model.py).
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from streamrl.common.messages import PromptWorkItem, SamplingParams, Tensor
from streamrl.rollout.agents import openai_server
from streamrl.rollout.agents.config import AgentEndpointConfig, agent_token
from streamrl.rollout.agents.conversation import AgentEpisode
from streamrl.rollout.agents.gateway import AgentGateway
from streamrl.rollout.config import EnvironmentConfig, RolloutConfig
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import GenerationRequest, Sample

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "agent"))
import chat_model

TOKEN = "test-token"
TOKENIZER = chat_model.build_chat_tokenizer()
EOS = TOKENIZER.eos_token_id


def ids(text: str) -> list[int]:
    return list(TOKENIZER(text, add_special_tokens=False)["input_ids"])


class ScriptEngine:
    """Answers ``script(context)`` then EOS; log-prob of position p (in the whole sequence) is -0.01 (p + 1)."""

    def __init__(self, script: Callable[[str], str] = lambda context: "42") -> None:
        self.script = script
        self.version = 3
        self.requests: list[GenerationRequest] = []

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        (request,) = requests
        self.requests.append(request)
        context = TOKENIZER.decode(request.prompt_ids, skip_special_tokens=False)
        out = [*ids(self.script(context)), EOS][: request.sampling.max_new_tokens]
        finish = "stop" if out[-1] == EOS else "length"
        start = len(request.prompt_ids)
        logprobs = [-0.01 * (start + i + 1) for i in range(len(out))]
        text = TOKENIZER.decode(out, skip_special_tokens=True)
        return [[Sample(out, logprobs, text, finish, self.version, self.version)]]  # type: ignore[arg-type]


def item(n: int = 1, max_new_tokens: int = 8, group: str = "p1") -> PromptWorkItem:
    return PromptWorkItem(
        id=group,
        prompt_ids=Tensor.from_list([4, 5], "int32"),
        prompt_text="12+34=",
        label="46",
        metadata={"source": "test"},
        sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, n=n),
        policy_version=3,
    )


@asynccontextmanager
async def endpoint(engine: ScriptEngine, **overrides: Any) -> AsyncIterator[tuple[str, AgentGateway]]:
    cfg = AgentEndpointConfig(port=0, **overrides)
    server, gateway = openai_server.build(engine, TOKENIZER, cfg, 64, "tiny", TOKEN)  # type: ignore[arg-type]
    async with openai_server.serve(server, gateway, cfg) as url:
        yield url, gateway


async def take(url: str, token: str = TOKEN, wait_s: float = 5.0) -> httpx.Response:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
        return await http.post(f"{url}/streamrl/episodes", json={"wait_s": wait_s})


async def report(url: str, episode: str, reward: float, **extra: Any) -> httpx.Response:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        return await http.post(f"{url}/streamrl/episodes/{episode}/reward", json={"reward": reward, **extra})


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(main())  # type: ignore[arg-type]


async def chat(task: dict[str, Any], messages: list[dict[str, str]], **kwargs: Any) -> Any:
    async with openai.AsyncOpenAI(base_url=task["base_url"], api_key=TOKEN, max_retries=0) as client:
        return await client.chat.completions.create(
            model=task["model"], messages=messages, logprobs=True, extra_body={"return_token_ids": True}, **kwargs
        )


def test_a_conversation_of_two_requests_becomes_one_token_exact_episode() -> None:
    engine = ScriptEngine(lambda context: "46" if context.endswith("=<|assistant|>") else "7")

    async def main() -> tuple[list[Any], list[Any], dict[str, Any]]:
        async with endpoint(engine) as (url, gateway):
            group = asyncio.create_task(gateway.run_group(item(n=2)))
            tasks = [(await take(url)).json() for _ in range(2)]
            replies = []
            for task in tasks:
                messages = [{"role": "user", "content": task["prompt"]}]
                first = await chat(task, messages)
                messages += [
                    {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "#"},
                ]
                second = await chat(task, messages)
                assert (await report(url, task["id"], 0.5 + task["index"])).status_code == 200
                replies.append((first, second))
            return await group, replies, tasks[0]

    episodes, replies, task = run(main)
    assert {k: task[k] for k in ("group_id", "index", "group_size", "prompt", "label", "metadata", "is_eval")} == {
        "group_id": "p1",
        "index": 0,
        "group_size": 2,
        "prompt": "12+34=",
        "label": "46",
        "metadata": {"source": "test"},
        "is_eval": False,
    }
    for j, (episode, (first, second)) in enumerate(zip(episodes, replies, strict=True)):
        assert isinstance(episode, AgentEpisode)
        assert first.choices[0].message.content == "46" and second.choices[0].message.content == "7"
        # the prompt the engine saw: the template's text, tokenized once
        assert episode.prompt_ids == first.prompt_token_ids == ids("<|user|>12+34=<|assistant|>")
        assert episode.prompt_text == "<|user|>12+34=<|assistant|>"
        extra = ids("<|user|>#<|assistant|>")
        assert episode.token_ids == first.choices[0].token_ids + extra + second.choices[0].token_ids
        assert second.prompt_token_ids == episode.prompt_ids + first.choices[0].token_ids + extra
        assert [r.prompt_ids for r in engine.requests[2 * j : 2 * j + 2]] == [
            first.prompt_token_ids,
            second.prompt_token_ids,
        ]
        assert episode.loss_mask == [1] * 3 + [0] * 3 + [1] * 2
        returned = [t.logprob for t in first.choices[0].logprobs.content + second.choices[0].logprobs.content]
        assert [lp for lp, m in zip(episode.logprobs, episode.loss_mask, strict=True) if m] == returned
        assert [lp for lp, m in zip(episode.logprobs, episode.loss_mask, strict=True) if not m] == [0.0] * 3
        assert [(t.start, t.end, t.policy_version) for t in episode.turns] == [(0, 3, 3), (6, 8, 3)]
        assert (episode.reward, episode.stop_reason, episode.finish_reason) == (0.5 + j, "done", "stop")
        assert episode.text == "46</s><|user|>#<|assistant|>7</s>"
        assert first.policy_version == 3 and first.usage.completion_tokens == 3


def test_the_completions_route_with_the_episode_header() -> None:
    engine = ScriptEngine(lambda context: "5")

    async def main() -> tuple[Any, Any, AgentEpisode]:
        async with endpoint(engine) as (url, gateway):
            group = asyncio.create_task(gateway.run_group(item()))
            task = (await take(url)).json()
            headers = {"X-Streamrl-Episode": task["id"]}
            async with openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0, default_headers=headers) as c:
                first = await c.completions.create(model="tiny", prompt="1+2=", logprobs=1)
                second = await c.completions.create(model="tiny", prompt="1+2=5</s>#", max_tokens=1)
            await report(url, task["id"], 1.0)
            (episode,) = await group
            return first, second, episode

    first, second, episode = run(main)
    assert first.choices[0].text == "5" and first.choices[0].logprobs.tokens == ["5", "</s>"]
    assert first.choices[0].logprobs.token_logprobs == [-0.05, -0.06]
    assert second.choices[0].finish_reason == "length" and second.choices[0].text == "5"
    assert episode.prompt_ids == ids("1+2=")
    assert episode.token_ids == ids("5</s>#5") and episode.loss_mask == [1, 1, 0, 1]


def test_requests_without_the_bearer_token_get_401() -> None:
    async def main() -> None:
        async with endpoint(ScriptEngine()) as (url, _):
            assert (await take(url, token="wrong")).status_code == 401
            async with httpx.AsyncClient() as http:
                assert (await http.post(f"{url}/streamrl/episodes")).status_code == 401
            async with openai.AsyncOpenAI(base_url=url, api_key="wrong", max_retries=0) as client:
                with pytest.raises(openai.AuthenticationError):
                    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1"}])
            assert (await take(url, wait_s=0)).status_code == 204  # the right token: no task yet

    run(main)


def test_a_rewritten_history_is_refused_and_the_conversation_goes_on() -> None:
    async def main() -> AgentEpisode:
        async with endpoint(ScriptEngine()) as (url, gateway):
            group = asyncio.create_task(gateway.run_group(item()))
            task = (await take(url)).json()
            await chat(task, [{"role": "user", "content": "1+1="}])
            for wrong in (
                [{"role": "user", "content": "1+2="}],  # another first message
                [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "43"}],
            ):
                with pytest.raises(openai.BadRequestError, match="differs from the one recorded"):
                    await chat(task, wrong)
            right = [
                {"role": "user", "content": "1+1="},
                {"role": "assistant", "content": "42"},
                {"role": "user", "content": "#"},
            ]
            await chat(task, right)
            await report(url, task["id"], 0.0)
            (episode,) = await group
            return episode

    episode = run(main)
    assert episode.token_ids == ids("42</s><|user|>#<|assistant|>42</s>")
    assert len(episode.turns) == 2


def test_requests_that_would_change_the_runs_sampling_are_refused() -> None:
    async def main() -> None:
        async with endpoint(ScriptEngine()) as (url, gateway):
            group = asyncio.create_task(gateway.run_group(item()))
            task = (await take(url)).json()
            messages = [{"role": "user", "content": "1"}]
            for kwargs, match in [
                ({"temperature": 0.5}, "temperature"),
                ({"n": 2}, "n must be 1"),
                ({"stream": True}, "stream"),
                ({"top_logprobs": 2}, "top_logprobs"),
            ]:
                with pytest.raises(openai.BadRequestError, match=match):
                    await chat(task, messages, **kwargs)
            ok = await chat(task, messages, temperature=1.0, max_tokens=1)  # the run's temperature is fine
            assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 1
            group.cancel()

    run(main)


def test_a_conversation_without_a_reply_cannot_be_finished_and_a_full_one_gets_no_more() -> None:
    async def main() -> None:
        async with endpoint(ScriptEngine(lambda context: "123456789"), max_tokens=13) as (url, gateway):
            group = asyncio.create_task(gateway.run_group(item()))
            task = (await take(url)).json()
            refused = await report(url, task["id"], 1.0)
            assert refused.status_code == 400 and "at least one model turn" in refused.json()["error"]["message"]
            messages = [{"role": "user", "content": "1"}]
            first = await chat(task, messages)  # 8 tokens (max_new_tokens) of the 13 after the prompt
            assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 8
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "2"},
            ]
            second = await chat(task, messages)  # "</s><|user|>2<|assistant|>" leave one token
            assert second.usage.completion_tokens == 1
            messages += [
                {"role": "assistant", "content": second.choices[0].message.content},
                {"role": "user", "content": "3"},
            ]
            with pytest.raises(openai.BadRequestError, match="no room for a reply"):
                await chat(task, messages)
            assert (await report(url, task["id"], 1.0)).json() == {
                "trajectory_id": "p1/0",
                "num_turns": 2,
                "num_tokens": 8 + 4 + 1,
                "num_model_tokens": 9,
            }
            await group

    run(main)


def test_per_turn_rewards_become_the_turns_rewards_and_must_match_the_replies() -> None:
    async def main() -> Any:
        async with endpoint(ScriptEngine(lambda context: "7")) as (url, gateway):
            group = asyncio.create_task(gateway.run_group(item()))
            task = (await take(url)).json()
            messages = [{"role": "user", "content": "1"}]
            first = await chat(task, messages)
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "2"},
            ]
            await chat(task, messages)
            for bad, error in (
                ([0.5], "turn_rewards has 1 values but the conversation has 2 model turns"),
                ([0.5, "x"], "turn_rewards\\[\\] must be a finite number, got 'x'"),
                (0.5, "turn_rewards must be a list of numbers"),
            ):
                refused = await report(url, task["id"], 1.0, turn_rewards=bad)
                assert refused.status_code == 400 and re.search(error, refused.json()["error"]["message"]), refused.text
            assert (await report(url, task["id"], 1.0, turn_rewards=[0.25, -0.5])).status_code == 200
            return await group

    (episode,) = run(main)
    assert [t.reward for t in episode.turns] == [0.25, -0.5] and episode.reward == 1.0


def test_an_idle_conversation_times_out_and_its_sample_is_offered_again(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> tuple[dict[str, Any], dict[str, Any], AgentEpisode]:
        async with endpoint(ScriptEngine(), idle_timeout_s=1.0) as (url, gateway):
            group = asyncio.create_task(gateway.run_group(item()))
            stale = (await take(url)).json()  # and never used
            assert (await take(url, wait_s=0)).status_code == 204  # the only sample is taken
            fresh = (await take(url, wait_s=10)).json()  # offered again once the first one timed out
            with pytest.raises(openai.NotFoundError):
                await chat(stale, [{"role": "user", "content": "1"}])
            await chat(fresh, [{"role": "user", "content": "2"}])
            await report(url, fresh["id"], 1.0)
            (episode,) = await group
            return stale, fresh, episode

    stale, fresh, episode = run(main)
    assert fresh["id"] != stale["id"] and fresh["trajectory_id"] == stale["trajectory_id"] == "p1/0"
    assert episode.prompt_ids == ids("<|user|>2<|assistant|>") and len(episode.turns) == 1
    assert f"agent conversation {stale['id']} on p1/0 dropped (no request for 1 s)" in caplog.text


def test_a_withdrawn_group_ends_its_conversations() -> None:
    async def main() -> None:
        async with endpoint(ScriptEngine()) as (url, gateway):
            group = asyncio.create_task(gateway.run_group(item(n=2)))
            task = (await take(url)).json()
            group.cancel()  # the worker stops: the work item goes back to the stream
            with pytest.raises(asyncio.CancelledError):
                await group
            with pytest.raises(openai.NotFoundError):
                await chat(task, [{"role": "user", "content": "1"}])
            assert (await take(url, wait_s=0)).status_code == 204  # its other sample is not offered

    run(main)


def test_the_agent_section_is_checked() -> None:
    env = EnvironmentConfig(path="streamrl.rollout.environments.calculator")
    with pytest.raises(ValueError, match="exclude each other"):
        RolloutConfig(run_id="r", engine=EngineConfig(model="m"), agent=AgentEndpointConfig(), environment=env)
    with pytest.raises(ValueError, match=r"STREAMRL_TEST_NO_SUCH_TOKEN"):
        agent_token(AgentEndpointConfig(token_env="STREAMRL_TEST_NO_SUCH_TOKEN"))
