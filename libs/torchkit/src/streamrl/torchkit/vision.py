"""Vision-language checkpoints, as both torch services read them: the vision tower test and the processor.

A checkpoint is vision-language when its config has a ``vision_config``; it then comes with an
``AutoProcessor`` (tokenizer + image processor) that names the *image token*, the one token that
stands for an image in a prompt before the processor expands it. The rollout engines and the
learner load the processor with :func:`load_processor` and read the token with
:func:`image_token_id`, so both see the same ids. transformers is imported inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def has_vision_tower(config: Any) -> bool:
    """Whether a transformers model config is a vision-language model's (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def is_vision_language(model: str | Path, trust_remote_code: bool = False) -> bool:
    """Whether the checkpoint at ``model`` is a vision-language model (reads its config only)."""
    from transformers import AutoConfig

    return has_vision_tower(AutoConfig.from_pretrained(str(model), trust_remote_code=trust_remote_code))


def load_processor(model: str | Path, trust_remote_code: bool = False) -> Any:
    """The ``AutoProcessor`` of the vision-language checkpoint at ``model``; ValueError when it names
    no image token (``processor.image_token``)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    if getattr(processor, "image_token", None) is None:
        raise ValueError(
            f"the processor of {model} ({type(processor).__name__}) names no image token (processor.image_token)"
        )
    return processor


def image_token_id(processor: Any) -> int:
    """Id of the token that stands for one image in a prompt (before the processor expands it)."""
    token_id = getattr(processor, "image_token_id", None)
    if token_id is None:
        token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return int(token_id)
