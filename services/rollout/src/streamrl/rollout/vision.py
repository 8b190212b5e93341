"""Images for vision-language policies: decoding, the model's processor, and image-token expansion.

A prompt with images holds one image token per image (the *collapsed* form: what the chat template
renders and what the engines take); the model sees each of them replaced by that image's tokens
(the *expanded* form: ``<fake_token_around_image><global-img>`` + ``<image>`` x 4 +
``<fake_token_around_image>`` for the tiny Idefics3, a number of ``<|image_pad|>`` that depends on
the image size for Qwen2-VL). Engines always get the collapsed form (vLLM expands it itself;
expanded ids given to it would be expanded again); trajectories record the expanded form, which
is what the learner feeds its model next to the pixel values of the same images.

The expansion of an image is the model's own processor run on that image's token alone: an
image's tokens do not depend on the text around them (the processor splits the text at image
tokens), so a prompt's expansion is the concatenation of its pieces. :func:`encode` checks that
claim for every prompt the transformers engine runs, against the processor's output for all of
the prompt's images at once.

Which checkpoints are vision-language, their processor and its image token are
:mod:`streamrl.torchkit.vision`'s (the learner reads them with the same code).

Images travel as :class:`streamrl.common.messages.Image` (encoded bytes) everywhere; every
consumer decodes them with :func:`streamrl.common.images.decode_image` (PIL, converted to RGB as the processors do
anyway), so the rollout engines and the learner see the same pixels.

A policy never samples an image's tokens (:func:`expansion_token_ids`: ``<image>``,
``<fake_token_around_image>`` and ``<global-img>`` for the tiny Idefics3): a response holding one
would stand for an image that is not there, and the learner refuses such a trajectory (an image
token with loss mask 1, or more image tokens than its images make), which costs a whole batch.
Both engines give those ids a logit of -inf before sampling, so the behaviour log-probs they record
are those of the distribution restricted to the other tokens. The learner recomputes log-probs
over the full vocabulary: for a sampled token the two differ by ``log(1 - p(image tokens))``, tiny
for a trained policy (it practically never writes them unprompted), and truncated importance
sampling corrects it like any other mismatch between the engine and the learner.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import PIL.Image

from streamrl.common.images import decode_image, encode_png
from streamrl.common.messages import Image
from streamrl.torchkit.vision import image_token_id, is_vision_language, load_processor

if TYPE_CHECKING:
    import torch


def to_image(value: Any) -> Image:
    """An :class:`Image` message from an ``Image`` (returned as it is, once its bytes decode) or a PIL
    image (stored as PNG: lossless, so what is decoded later is exactly these pixels, as RGB)."""
    if isinstance(value, Image):
        decode_image(value)
        return value
    if isinstance(value, PIL.Image.Image):
        return encode_png(value)
    raise ValueError(f"an image must be a streamrl Image or a PIL image, not a {type(value).__name__}")


def vision_processor(model: str | Path, trust_remote_code: bool = False) -> Any:
    """The model's processor (tokenizer + image processor) when ``model`` is a vision-language model,
    else None (:mod:`streamrl.torchkit.vision`: the learner loads it the same way)."""
    if not is_vision_language(model, trust_remote_code):
        return None
    return load_processor(model, trust_remote_code)


def expansion_token_ids(processor: Any) -> list[int]:
    """The ids a policy must never sample: the image token and the other added tokens (never ordinary
    text, such as a row's line break) of one image's expansion, sorted.

    One square image stands for all: what an image expands into depends on its size only in how
    many tokens there are (Qwen2-VL: more ``<|image_pad|>``) and, for processors that tile images,
    in which tile tags appear (Idefics3 / SmolVLM: ``<row_i_col_j>``; they rescale an image's
    longest side to their largest, so a square one gets the largest grid).
    """
    expansion = image_expansion(processor, PIL.Image.new("RGB", (64, 64)))
    added = set(processor.tokenizer.added_tokens_decoder)
    return sorted({t for t in expansion if t in added} | {image_token_id(processor)})


def check_image_count(ids: Sequence[int], num_images: int, token_id: int | None) -> None:
    """ValueError unless ``ids`` hold exactly one image token per image."""
    if token_id is None:
        if num_images:
            raise ValueError(f"a request with {num_images} image(s) for a model that is not a vision-language model")
        return
    found = sum(1 for t in ids if t == token_id)
    if found != num_images:
        raise ValueError(
            f"the prompt holds {found} image token(s) (id {token_id}) for {num_images} image(s): "
            "give one image token per image, not expanded"
        )


class ImageExpander:
    """Collapsed ids and their :class:`Image` messages -> the ids the model sees, with the model's processor."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.token_id = image_token_id(processor)
        """The image token."""

    def __call__(self, ids: Sequence[int], images: Sequence[Image]) -> list[int]:
        """ValueError for a bad image or when the image tokens do not match the images."""
        return expand_image_tokens(self.processor, ids, [decode_image(image) for image in images])


def load_expander(model: str | Path, trust_remote_code: bool = False) -> ImageExpander | None:
    """The expander of a vision-language model's processor; None for a text model."""
    processor = vision_processor(model, trust_remote_code)
    return None if processor is None else ImageExpander(processor)


def image_expansion(processor: Any, image: PIL.Image.Image) -> list[int]:
    """The tokens the model sees for ``image`` in place of its one image token."""
    out = processor(text=processor.image_token, images=[image], add_special_tokens=False)
    return [int(t) for t in out["input_ids"][0]]


def expand_image_tokens(processor: Any, ids: Sequence[int], images: Sequence[PIL.Image.Image]) -> list[int]:
    """``ids`` with its ``k``-th image token replaced by the expansion of ``images[k]``.

    Raises ValueError when the number of image tokens is not the number of images.
    """
    return _expand(processor, ids, images)[0]


def encode(
    processor: Any, ids: Sequence[int], images: Sequence[PIL.Image.Image]
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The expanded ids of a prompt and the model's pixel inputs for its images (``pixel_values`` and
    whatever else the processor makes for them, batch of one), as the transformers model takes them.

    The processor runs once more on all the images together, and its tokens must be the images'
    expansions one after the other (else ValueError: the expansion would depend on the context).
    """
    expanded, pieces = _expand(processor, ids, images)
    joint = processor(text=[processor.image_token * len(images)], images=[list(images)], return_tensors="pt")
    if joint["input_ids"][0].tolist() != [t for piece in pieces for t in piece]:
        raise ValueError(
            f"{type(processor).__name__} expands an image differently next to another image: "
            "token-exact image prompts are not supported for this model"
        )
    return expanded, {k: v for k, v in joint.items() if k not in ("input_ids", "attention_mask")}


def _expand(processor: Any, ids: Sequence[int], images: Sequence[PIL.Image.Image]) -> tuple[list[int], list[list[int]]]:
    """(expanded ids, the expansion of each image)."""
    token_id = image_token_id(processor)
    check_image_count(ids, len(images), token_id)
    pieces = [image_expansion(processor, image) for image in images]
    out: list[int] = []
    k = 0
    for t in ids:
        if t == token_id:
            out.extend(pieces[k])
            k += 1
        else:
            out.append(int(t))
    return out, pieces
