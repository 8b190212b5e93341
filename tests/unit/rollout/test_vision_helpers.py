"""Image helpers of the rollout tier on the tiny Idefics3: decoding, the processor, image-token
expansion, and the images an environment step may return."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from streamrl.common.messages import Image
from streamrl.rollout.environments.environment import EnvironmentCallError, as_step_result
from streamrl.rollout.vision import (
    check_image_count,
    decode_image,
    encode,
    expand_image_tokens,
    image_token_id,
    load_expander,
    to_image,
    vision_processor,
)
from streamrl.torchkit.testing import build_tiny_idefics3, build_tiny_qwen2

IMAGE, AROUND, GLOBAL = 387, 386, 388
"""Ids of ``<image>``, ``<fake_token_around_image>`` and ``<global-img>`` in the tiny Idefics3."""
EXPANSION = [AROUND, GLOBAL, IMAGE, IMAGE, IMAGE, IMAGE, AROUND]


def pixels(seed: int, size: tuple[int, int] = (40, 50), mode: str = "RGB") -> PIL.Image.Image:
    array = (np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")
    return PIL.Image.fromarray(array).convert(mode)


def encoded(image: PIL.Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def processor(vl_dir: Path) -> object:
    return vision_processor(vl_dir)


def test_to_image_keeps_messages_and_stores_pil_images_as_png() -> None:
    message = Image("image/jpeg", encoded(pixels(2), "JPEG"))
    assert to_image(message) is message
    grey = pixels(3, mode="L")
    stored = to_image(grey)
    assert stored.media_type == "image/png"
    assert np.array_equal(np.asarray(decode_image(stored)), np.asarray(grey.convert("RGB")))
    with pytest.raises(ValueError, match="not a bytes"):
        to_image(b"raw bytes")
    with pytest.raises(ValueError, match="cannot be decoded"):
        to_image(Image("image/png", b"junk"))


def test_only_vision_language_models_have_a_processor(vl_dir: Path, tmp_path: Path, processor: object) -> None:
    assert vision_processor(build_tiny_qwen2(tmp_path / "text")) is None
    assert load_expander(tmp_path / "text") is None
    assert image_token_id(processor) == IMAGE
    expander = load_expander(vl_dir)
    assert expander is not None and expander.token_id == IMAGE


def test_each_image_token_becomes_what_the_processor_makes_of_that_image(processor: object) -> None:
    a, b = pixels(4), pixels(5, size=(90, 30))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "one"}, {"type": "image"}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)  # type: ignore[attr-defined]
    collapsed = processor.tokenizer(text)["input_ids"]  # type: ignore[attr-defined]
    assert collapsed.count(IMAGE) == 2
    expanded = expand_image_tokens(processor, collapsed, [a, b])
    assert expanded == processor(text=text, images=[[a, b]])["input_ids"][0]  # type: ignore[operator]
    first = collapsed.index(IMAGE)
    assert expanded[first : first + len(EXPANSION)] == EXPANSION
    assert len(expanded) == len(collapsed) + 2 * (len(EXPANSION) - 1)
    assert expand_image_tokens(processor, [5, 6], []) == [5, 6]

    ids, inputs = encode(processor, collapsed, [a, b])
    assert ids == expanded
    assert sorted(inputs) == ["pixel_attention_mask", "pixel_values"]
    assert tuple(inputs["pixel_values"].shape) == (1, 2, 3, 64, 64)


def test_image_tokens_must_match_the_images(processor: object) -> None:
    a = pixels(6)
    with pytest.raises(ValueError, match=r"holds 2 image token\(s\) \(id 387\) for 1 image"):
        expand_image_tokens(processor, [5, IMAGE, 6, IMAGE], [a])
    with pytest.raises(ValueError, match=r"holds 0 image token\(s\) \(id 387\) for 1 image"):
        expand_image_tokens(processor, [5, 6], [a])
    already = expand_image_tokens(processor, [5, IMAGE], [a])
    with pytest.raises(ValueError, match=r"holds 4 image token.*not expanded"):
        expand_image_tokens(processor, already, [a])
    with pytest.raises(ValueError, match="not a vision-language model"):
        check_image_count([5, 6], 1, None)
    check_image_count([5, IMAGE], 0, None)  # a text model has no image token: any id is text


def test_a_step_may_return_images_and_a_text_step_is_unchanged() -> None:
    plain = as_step_result({"observation": "<result>3</result>", "reward": 0.5})
    assert (plain.observation, plain.reward, plain.images) == ("<result>3</result>", 0.5, [])
    message = Image("image/png", encoded(pixels(7)))
    result = as_step_result({"observation": "look: <image>", "images": [pixels(8), message]})
    assert [i.media_type for i in result.images] == ["image/png", "image/png"] and result.images[1] is message
    with pytest.raises(EnvironmentCallError, match=r"bad image: .*cannot be decoded as PNG"):
        as_step_result({"observation": "<image>", "images": [Image("image/png", b"junk")]})
    with pytest.raises(EnvironmentCallError, match="images of type Image, not a list"):
        as_step_result({"observation": "<image>", "images": message})
    with pytest.raises(EnvironmentCallError, match="bad image: an image must be a streamrl Image or a PIL image"):
        as_step_result({"observation": "<image>", "images": ["path/to.png"]})
