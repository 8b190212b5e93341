"""Both engines never sample an image's tokens, and record the log-probs of the distribution over the
other tokens.

The tiny Idefics3 is edited so that it wants to write them: every token's embedding gets a constant
``LIFT`` in dimension 0 (the last hidden state then has a large positive dimension 0 after any text
token; the lift itself shifts every logit alike), and the tokens of an image's expansion get a little
more there. With tied embeddings that makes ``<image>``, ``<global-img>`` and
``<fake_token_around_image>`` the three favourites by ~17 nats after every text token: unrestricted,
a sample would be nothing but image tokens.
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
from transformers import AutoModelForImageTextToText, PreTrainedModel

from streamrl.common.messages import Image, SamplingParams
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import Engine, GenerationRequest, Sample
from streamrl.rollout.engines.factory import build_engine
from streamrl.rollout.vision import decode_image, expansion_token_ids, vision_processor
from streamrl.rollout.vision import encode as encode_images
from streamrl.torchkit.testing import build_tiny_idefics3
from streamrl.torchkit.vision import image_token_id

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
LIFT = 10.0
"""Dimension 0 of every token embedding."""
FAVOURITES = (4.0, 5.0, 4.5)
"""What the tokens of an image's expansion (in id order) get on top of ``LIFT``."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_tiny_idefics3(tmp_path_factory.mktemp("idefics3") / "m")
    model = AutoModelForImageTextToText.from_pretrained(path)
    banned = expansion_token_ids(vision_processor(path))
    embeddings = model.get_input_embeddings().weight
    assert embeddings is model.get_output_embeddings().weight, "tied embeddings"
    with torch.no_grad():
        embeddings[:, 0] = LIFT
        embeddings[banned, 0] += torch.tensor(FAVOURITES)
    model.save_pretrained(path)  # the processor's files stay
    return path


@pytest.fixture(scope="module")
def processor(model_dir: Path) -> Any:
    return vision_processor(model_dir)


@pytest.fixture(scope="module")
def banned(processor: Any) -> list[int]:
    return expansion_token_ids(processor)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> PreTrainedModel:
    return AutoModelForImageTextToText.from_pretrained(model_dir).eval()


def engine_config(model: Path, engine_type: str) -> EngineConfig:
    return EngineConfig(
        type=engine_type,
        model=str(model),
        dtype="float32",
        max_model_len=256,
        kv_cache_gib=0.25,
        enforce_eager=True,
        max_images_per_prompt=2,
    )  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["vllm", "hf"])
def engine(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Engine]:
    built = build_engine(engine_config(model_dir, request.param))
    yield built
    built.close()


def png(seed: int, size: tuple[int, int]) -> Image:
    array = (np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    PIL.Image.fromarray(array).save(buffer, format="PNG")
    return Image("image/png", buffer.getvalue())


def prompt_ids(processor: Any, num_images: int) -> list[int]:
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": "what is this"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return list(processor.tokenizer(text)["input_ids"])


def logits_of(model: PreTrainedModel, processor: Any, prompt: list[int], sample: Sample, images: list[Image]) -> Any:
    """[len(tokens), V] the full model's logits before each sampled token (the images' pixels with it)."""
    pixels: dict[str, torch.Tensor] = {}
    if images:
        token = image_token_id(processor)
        _, pixels = encode_images(processor, [token] * len(images), [decode_image(i) for i in images])
    ids = prompt + sample.token_ids
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), **pixels).logits[0, len(prompt) - 1 : -1].float()


def test_the_forbidden_ids_are_the_added_tokens_of_an_image(processor: Any, banned: list[int]) -> None:
    names = ["<fake_token_around_image>", "<image>", "<global-img>"]
    assert banned == sorted(processor.tokenizer.convert_tokens_to_ids(names))


def test_the_engine_never_samples_an_images_tokens_and_records_the_restricted_log_probs(
    engine: Engine, processor: Any, model: PreTrainedModel, banned: list[int]
) -> None:
    images = [png(0, (40, 50))]
    with_image, text_only = prompt_ids(processor, 1), prompt_ids(processor, 0)
    requests = [
        GenerationRequest(with_image, SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=3), images),
        GenerationRequest(text_only, SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=4)),
        GenerationRequest(with_image, SamplingParams(temperature=0, max_new_tokens=12), images),
    ]
    results = asyncio.run(engine.generate(requests))
    sampled = [t for samples in results[:2] for s in samples for t in s.token_ids]
    assert len(sampled) >= 36, "a few dozen tokens at temperature 1"
    for request, samples in zip(requests, results, strict=True):
        temperature = request.sampling.temperature
        for s in samples:
            assert not set(s.token_ids) & set(banned), s.token_ids
            prompt = s.prompt_ids if request.images else request.prompt_ids
            assert prompt is not None
            logits = logits_of(model, processor, list(prompt), s, list(request.images))
            full = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
            assert (full[:, banned].exp().sum(dim=-1) > 0.99).all(), "the model itself would write image tokens"
            restricted = logits.index_fill(1, torch.tensor(banned), float("-inf"))
            logp = torch.log_softmax(restricted / (temperature or 1.0), dim=-1)
            tokens = torch.tensor(s.token_ids)
            torch.testing.assert_close(
                torch.tensor(s.logprobs), logp.gather(1, tokens[:, None])[:, 0], atol=1e-3, rtol=0
            )
            if temperature == 0:
                assert s.token_ids == restricted.argmax(dim=-1).tolist(), "greedy: the best allowed token"
