"""Both generation engines on the tiny Idefics3: image prompts, their expanded ids, log-probs with the
same pixels, weight updates, and a multi-turn episode whose environment returns an image.

What a learner does with a trajectory is checked here too: transformers, given the recorded
(expanded) ids and the pixel values of the recorded images, gives the recorded behaviour log-probs.
One vLLM engine and one transformers engine are shared by the module.
"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
from committed import handled
from transformers import AutoModelForImageTextToText, PreTrainedModel

from streamrl.common.bus import Bus, connect
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import Image, PromptWorkItem, SamplingParams, Tensor, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.rollout.config import EnvironmentConfig, RolloutConfig
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import Engine, GenerationRequest, Sample
from streamrl.rollout.engines.factory import build_engine
from streamrl.rollout.environments.episode import EpisodeRunner
from streamrl.rollout.service import RolloutService
from streamrl.rollout.vision import (
    ImageExpander,
    decode_image,
    expand_image_tokens,
    expansion_token_ids,
    vision_processor,
)
from streamrl.rollout.vision import encode as encode_images
from streamrl.torchkit.testing import build_tiny_idefics3, weights_event
from streamrl.torchkit.weights.zmq import ZmqPublisher

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
IMAGE = 387
"""Id of ``<image>`` in the tiny Idefics3."""


def png(seed: int, size: tuple[int, int]) -> Image:
    array = (np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    PIL.Image.fromarray(array).save(buffer, format="PNG")
    return Image("image/png", buffer.getvalue())


IMAGES = [png(0, (40, 50)), png(1, (90, 30))]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("idefics3")
    return build_tiny_idefics3(root / "a", seed=0), build_tiny_idefics3(root / "b", seed=1)


@pytest.fixture(scope="module")
def processor(model_dirs: tuple[Path, Path]) -> Any:
    return vision_processor(model_dirs[0])


@pytest.fixture(scope="module")
def models(model_dirs: tuple[Path, Path]) -> tuple[PreTrainedModel, PreTrainedModel]:
    a, b = (AutoModelForImageTextToText.from_pretrained(d).eval() for d in model_dirs)
    return a, b


def prompt_ids(processor: Any, num_images: int, question: str = "what is this") -> list[int]:
    """A chat prompt with ``num_images`` images before the question (one ``<image>`` each: collapsed)."""
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return list(processor.tokenizer(text)["input_ids"])


def config(model: Path, engine_type: str) -> EngineConfig:
    return EngineConfig(
        type=engine_type,
        model=str(model),
        dtype="float32",
        max_model_len=256,
        kv_cache_gib=0.25,
        enforce_eager=True,
        max_images_per_prompt=3,
    )  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def vllm_engine(model_dirs: tuple[Path, Path]) -> Iterator[Engine]:
    engine = build_engine(config(model_dirs[0], "vllm"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(model_dirs: tuple[Path, Path]) -> Iterator[Engine]:
    engine = build_engine(config(model_dirs[0], "hf"))
    yield engine
    engine.close()


@pytest.fixture(params=["vllm", "hf"])
def engine(request: pytest.FixtureRequest) -> Engine:
    return request.getfixturevalue(f"{request.param}_engine")  # type: ignore[no-any-return]


def generate(engine: Engine, request: GenerationRequest) -> list[Sample]:
    ((*samples,),) = asyncio.run(engine.generate([request]))
    return samples


def reference_logprobs(
    model: PreTrainedModel, processor: Any, ids: list[int], images: list[Image], tokens: list[int], temperature: float
) -> torch.Tensor:
    """What a learner computes: the model on the expanded ids with the images' pixel values,
    log-probs of ``tokens`` (the last ones of ``ids``) at ``temperature`` (0: raw) - over the tokens
    the engines may sample (not an image's: a learner's full-vocabulary log-probs differ by
    log(1 - p(image tokens)), 1-2% for this random model)."""
    _, pixels = encode_images(processor, [IMAGE] * len(images), [decode_image(i) for i in images])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **pixels).logits[0, len(ids) - len(tokens) - 1 : -1]
    logits[:, expansion_token_ids(processor)] = float("-inf")
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def test_engines_expand_image_prompts_as_the_processor_and_agree(
    vllm_engine: Engine, hf_engine: Engine, processor: Any, models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    ids = prompt_ids(processor, 2)
    expanded = expand_image_tokens(processor, ids, [decode_image(i) for i in IMAGES])
    greedy = GenerationRequest(ids, SamplingParams(temperature=0, max_new_tokens=12), IMAGES)
    (from_vllm,), (from_hf,) = generate(vllm_engine, greedy), generate(hf_engine, greedy)
    assert from_vllm.prompt_ids == from_hf.prompt_ids == expanded
    assert len(from_vllm.token_ids) == 12 and from_vllm.token_ids == from_hf.token_ids
    _, pixels = encode_images(processor, ids, [decode_image(i) for i in IMAGES])
    alone = models[0].generate(input_ids=torch.tensor([expanded]), **pixels, max_new_tokens=12, do_sample=False)
    assert alone[0, len(expanded) :].tolist() == from_hf.token_ids
    for sample in (from_vllm, from_hf):
        ref = reference_logprobs(models[0], processor, expanded + sample.token_ids, IMAGES, sample.token_ids, 0)
        torch.testing.assert_close(torch.tensor(sample.logprobs), ref, atol=1e-3, rtol=0)

    text = GenerationRequest(prompt_ids(processor, 0), SamplingParams(temperature=0, max_new_tokens=8))
    (text_vllm,), (text_hf,) = generate(vllm_engine, text), generate(hf_engine, text)
    assert text_vllm.prompt_ids is None and text_hf.prompt_ids is None
    assert text_vllm.token_ids == text_hf.token_ids


def test_sampled_log_probs_are_the_models_with_the_same_pixels(
    engine: Engine, processor: Any, models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    ids = prompt_ids(processor, 1, "and this")
    sampling = SamplingParams(temperature=0.8, max_new_tokens=10, n=3, seed=5)
    samples = generate(engine, GenerationRequest(ids, sampling, IMAGES[1:]))
    assert len(samples) == 3
    for s in samples:
        assert s.prompt_ids is not None and s.prompt_ids.count(IMAGE) == 4
        ref = reference_logprobs(models[0], processor, s.prompt_ids + s.token_ids, IMAGES[1:], s.token_ids, 0.8)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-3, rtol=0)


def test_image_requests_that_cannot_be_served_are_refused(engine: Engine, processor: Any) -> None:
    ids = prompt_ids(processor, 1)
    expanded = expand_image_tokens(processor, ids, [decode_image(IMAGES[0])])
    sampling = SamplingParams(temperature=0, max_new_tokens=4)
    cases = [
        (GenerationRequest(ids, sampling, IMAGES), r"1 image token\(s\) \(id 387\) for 2 image"),
        (GenerationRequest(expanded, sampling, IMAGES[:1]), r"4 image token\(s\).*not expanded"),
        (GenerationRequest([IMAGE] * 4 + ids, sampling, IMAGES * 2 + IMAGES[:1]), "max_images_per_prompt=3"),
        (GenerationRequest(ids, sampling, [Image("image/png", b"junk")]), "cannot be decoded as PNG"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(engine, request)
    (after,) = generate(engine, GenerationRequest(ids, sampling, IMAGES[:1]))
    assert after.prompt_ids == expanded, "the engine still serves"


def test_a_weight_update_changes_what_the_vision_language_model_serves(
    engine: Engine, processor: Any, models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    """The learner publishes the whole AutoModelForImageTextToText under its transformers names."""
    ids = prompt_ids(processor, 1, "what now")
    greedy = GenerationRequest(ids, SamplingParams(temperature=0, max_new_tokens=10), IMAGES[:1])
    (before,) = generate(engine, greedy)
    server = ZmqPublisher(bucket_bytes=256 * 1024)
    try:
        for version, model in ((engine.version + 1, models[1]), (engine.version + 2, models[0])):
            published = server.publish(model.state_dict().items(), version=version)
            checksum = published["checksum"]
            asyncio.run(engine.update_weights(weights_event(version, endpoint=server.endpoint, checksum=checksum), 10))
            assert engine.version == version
            (served,) = generate(engine, greedy)
            assert served.prompt_ids is not None
            ref = reference_logprobs(
                model, processor, served.prompt_ids + served.token_ids, IMAGES[:1], served.token_ids, 0
            )
            torch.testing.assert_close(torch.tensor(served.logprobs), ref, atol=1e-3, rtol=0)
            if model is models[1]:
                assert served.token_ids != before.token_ids, "model B answers otherwise"
            else:
                assert served.token_ids == before.token_ids, "model A again"
    finally:
        server.close()


class Viewer:
    """An environment that shows the model an image after its first turn, then ends the episode."""

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, prompt: str, label: str | None, metadata: dict[str, Any]) -> None:
        return None

    def step(self, response: str) -> dict[str, Any]:
        self.steps += 1
        if self.steps == 1:
            picture = decode_image(png(7, (64, 64)))
            return {"observation": "<|im_end|>\n<|im_start|>user\nnow <image> this", "images": [picture], "reward": 0.5}
        return {"done": True, "reward": 1.0}


@pytest.fixture
def service(engine: Engine, redis_url: str, run_id: str, processor: Any) -> Iterator[RolloutService]:
    env = EnvironmentConfig(path="unused", max_turns=3, max_tokens=120)
    cfg = RolloutConfig(run_id=run_id, engine=EngineConfig(model="unused", type="hf"), environment=env)
    ctx = ServiceContext("rollout", "rollout-0", cfg, Bus(connect(redis_url)), StreamNames(run_id), asyncio.Event())
    tokenize = lambda text: list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    runner = EpisodeRunner(engine, Viewer, tokenize, env, 256, ImageExpander(processor))
    yield RolloutService(cfg, ctx, engine, runner)


def test_an_episode_records_the_environments_image_expanded_and_masked(
    service: RolloutService, processor: Any, models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    ids = prompt_ids(processor, 1, "look")
    (first,) = generate(
        service.engine, GenerationRequest(ids, SamplingParams(temperature=0, max_new_tokens=8), IMAGES[:1])
    )
    stop = first.text[2:5]  # the first turn ends at a stop string, so the environment sees it
    sampling = SamplingParams(temperature=0, max_new_tokens=8, stop=[stop])
    item = PromptWorkItem(
        id="v1", prompt_ids=Tensor.from_list(ids, "int32"), prompt_text="look", sampling=sampling, images=IMAGES[:1]
    )

    async def handle() -> Trajectory:
        try:
            (t,) = await handled(service.redis, await service.handle(item))  # as the reward tier and learner see it
        finally:
            await service.redis.aclose()
        return t

    t = asyncio.run(handle())
    prompt = expand_image_tokens(processor, ids, [decode_image(IMAGES[0])])
    assert t.prompt_ids.tolist() == prompt
    assert len(t.images) == 2 and t.images[0] == IMAGES[0] and t.images[1].media_type == "image/png"
    response, mask, logprobs = t.response_ids.tolist(), t.loss_mask.tolist(), t.logprobs.tolist()
    (turn0, turn1) = t.turns
    observation = processor.tokenizer("<|im_end|>\n<|im_start|>user\nnow <image> this", add_special_tokens=False)
    seen = expand_image_tokens(processor, observation["input_ids"], [decode_image(t.images[1])])
    assert response[turn0.end : turn1.start] == seen and seen.count(IMAGE) == 4
    assert mask == [1] * turn0.end + [0] * len(seen) + [1] * (turn1.end - turn1.start)
    assert all(lp == 0 for lp in logprobs[turn0.end : turn1.start])
    # the second turn ends at the stop string (the environment then ends the episode) or its length
    ended = {"stop": ("done", [0.5, 1.0]), "length": ("length", [0.5, 0.0])}[t.finish_reason]
    assert (t.stop_reason, [turn.reward for turn in t.turns]) == ended

    full = prompt + response  # a learner's forward: the recorded ids, the recorded images' pixels
    trained = [i for i, m in enumerate(mask) if m]
    _, pixels = encode_images(processor, [IMAGE, IMAGE], [decode_image(i) for i in t.images])
    with torch.no_grad():
        logits = models[0](input_ids=torch.tensor([full]), **pixels).logits[0]
    logits[:, expansion_token_ids(processor)] = float("-inf")  # the engines never sample them
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs)[trained], logp[trained], atol=1e-3, rtol=0)
