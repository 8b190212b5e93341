"""Multi-turn episodes with images over an engine stand-in (the tiny Idefics3's real processor):
collapsed engine contexts, expanded records, budgets in expanded tokens, and what stops an episode."""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import PIL.Image
import pytest

from streamrl.common.messages import Image, PromptWorkItem, SamplingParams, Tensor
from streamrl.rollout.config import EnvironmentConfig
from streamrl.rollout.engines.engine import GenerationRequest, Sample
from streamrl.rollout.environments.episode import Episode, EpisodeRunner
from streamrl.rollout.vision import ImageExpander, load_expander
from streamrl.torchkit.testing import build_tiny_idefics3

IMAGE, EOS = 387, 0
WIDTH = 7
"""Tokens of one image of the tiny Idefics3 once expanded."""


def picture(seed: int) -> PIL.Image.Image:
    return PIL.Image.fromarray((np.random.default_rng(seed).random((32, 32, 3)) * 255).astype("uint8"))


def png(seed: int) -> Image:
    buffer = io.BytesIO()
    picture(seed).save(buffer, format="PNG")
    return Image("image/png", buffer.getvalue())


@pytest.fixture(scope="module")
def expand(tmp_path_factory: pytest.TempPathFactory) -> ImageExpander:
    expander = load_expander(build_tiny_idefics3(tmp_path_factory.mktemp("idefics3")))
    assert expander is not None
    return expander


class Engine:
    """Writes ``turns[k]`` (then EOS) at turn ``k``; reports the expanded prompt as a real engine does,
    through ``report`` (the real expansion unless a test changes it)."""

    def __init__(self, turns: list[list[int]], report: Callable[[list[int], list[Image]], list[int]] | None) -> None:
        self.turns, self.report, self.version = turns, report, 0
        self.requests: list[GenerationRequest] = []

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        (request,) = requests
        self.requests.append(request)
        tokens = self.turns[len(self.requests) - 1] + [EOS]
        prompt = None if not request.images or self.report is None else self.report(request.prompt_ids, request.images)
        sample = Sample(tokens, [-0.5] * len(tokens), "turn", "stop", 0, 0, prompt)
        return [[sample]]


class Shows:
    """Answers the first step with ``observation`` and ``images``, the second with done."""

    def __init__(self, observation: list[int], images: list[Any]) -> None:
        self.observation, self.images, self.steps = observation, images, 0

    def reset(self, prompt: str, label: str | None, metadata: dict[str, Any]) -> None:
        return None

    def step(self, response: str) -> dict[str, Any]:
        self.steps += 1
        if self.steps > 1:
            return {"done": True}
        return {"observation": "obs", "images": self.images}


def run(
    engine: Engine, env: Shows, expand: ImageExpander | None, images: list[Image], max_tokens: int = 100
) -> Episode:
    config = EnvironmentConfig(path="unused", max_turns=3, max_tokens=max_tokens)
    observation = env.observation
    tokenize = lambda text: list(observation)  # noqa: E731 - every text is the observation's ids
    runner = EpisodeRunner(engine, lambda: env, tokenize, config, 512, expand)  # type: ignore[arg-type]
    prompt = [5, IMAGE, 6] if images else [5, 6]
    item = PromptWorkItem(
        id="p", prompt_ids=Tensor.from_list(prompt, "int32"), images=images, sampling=SamplingParams(max_new_tokens=10)
    )
    (episode,) = asyncio.run(runner.run_group(item))
    return episode


def test_the_engine_gets_collapsed_ids_and_every_image_the_record_is_expanded(expand: ImageExpander) -> None:
    engine = Engine([[10, 11], [12]], expand)
    shown = picture(3)
    episode = run(engine, Shows([20, IMAGE, 21], [shown]), expand, [png(1)])
    first, second = engine.requests
    assert (first.prompt_ids, first.images) == ([5, IMAGE, 6], [png(1)])
    assert second.prompt_ids == [5, IMAGE, 6, 10, 11, EOS, 20, IMAGE, 21]
    assert second.images[0] == png(1) and len(second.images) == 2 and second.images[1] == episode.images[0]
    image = expand([IMAGE], episode.images)
    assert len(image) == WIDTH
    assert episode.prompt_ids == expand([5, IMAGE, 6], [png(1)])
    assert episode.token_ids == [10, 11, EOS, 20, *image, 21, 12, EOS]
    assert episode.loss_mask == [1, 1, 1] + [0] * (WIDTH + 2) + [1, 1]
    assert episode.logprobs == [-0.5] * 3 + [0.0] * (WIDTH + 2) + [-0.5] * 2
    assert [(t.start, t.end) for t in episode.turns] == [(0, 3), (WIDTH + 5, WIDTH + 7)]
    assert episode.stop_reason == "done"


def test_a_text_prompt_may_get_images_from_the_environment(expand: ImageExpander) -> None:
    engine = Engine([[10], [12]], expand)
    episode = run(engine, Shows([IMAGE], [png(2)]), expand, [])
    assert episode.prompt_ids is None, "the prompt itself has no image: its ids are the record"
    assert episode.token_ids == [10, EOS, *expand([IMAGE], [png(2)]), 12, EOS]
    assert episode.images == [png(2)] and engine.requests[1].images == [png(2)]


def test_the_token_budget_counts_an_images_tokens(expand: ImageExpander) -> None:
    """3 tokens of turn and the image's 7 (one collapsed) leave no room for a turn in 10."""
    episode = run(Engine([[10, 11], [12]], expand), Shows([IMAGE], [png(2)]), expand, [], max_tokens=10)
    assert episode.stop_reason == "max_tokens" and episode.token_ids == [10, 11, EOS] and episode.images == []
    episode = run(Engine([[10, 11], [12]], expand), Shows([IMAGE], [png(2)]), expand, [], max_tokens=11)
    assert episode.stop_reason != "max_tokens" and len(episode.images) == 1


@pytest.mark.parametrize(
    ("observation", "images", "turn", "text_model", "message"),
    [
        ([20], [png(2)], [10], False, r"holds 0 image token\(s\) \(id 387\) for 1 image.*one image token per returned"),
        ([IMAGE, IMAGE], [png(2)], [10], False, r"holds 2 image token\(s\)"),
        ([IMAGE], [], [10], False, r"holds 1 image token\(s\) \(id 387\) for 0 image"),
        ([20], [], [10, IMAGE], False, r"the model wrote the image token \(id 387\)"),
        ([IMAGE], [png(2)], [10], True, r"returned 1 image\(s\) for a model that is not a vision-language model"),
    ],
)
def test_what_cannot_go_on_ends_the_episode_with_error(
    expand: ImageExpander, observation: list[int], images: list[Image], turn: list[int], text_model: bool, message: str
) -> None:
    model = None if text_model else expand
    engine = Engine([turn, [12]], model)
    episode = run(engine, Shows(observation, images), model, [])
    assert episode.stop_reason == "error" and episode.env_error is not None
    assert episode.env_error.startswith("turn 0: ")
    assert re.search(message, episode.env_error), episode.env_error
    assert len(engine.requests) == 1 and episode.token_ids == [*turn, EOS]


def test_an_engine_that_expands_otherwise_fails_the_prompt(expand: ImageExpander) -> None:
    engine = Engine([[10], [12]], lambda ids, images: expand(ids, images)[:-1])
    message = (
        r"turn 0 of p/0: the engine expanded the images into other tokens .* \(first difference at position 8 of 9\)"
    )
    with pytest.raises(ValueError, match=message):
        run(engine, Shows([20], []), expand, [png(1)])


def test_an_opening_text_with_an_image_token_fails_the_prompt(expand: ImageExpander) -> None:
    class Opens(Shows):
        def reset(self, prompt: str, label: str | None, metadata: dict[str, Any]) -> str:
            return "look"

    with pytest.raises(ValueError, match=r"opening text holds the image token \(id 387\), but reset returns no"):
        run(Engine([[10]], expand), Opens([IMAGE], []), expand, [])
