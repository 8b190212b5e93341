"""Tiny random checkpoints (Qwen2, and the Idefics3 vision-language model) with a locally trained tokenizer.

For tests, benchmarks and the CPU demos (examples/vlm/prepare.py); test-only code, so it lives here
rather than in a service, and no service module imports it. :func:`weights_event` turns a weight
publisher's fields into the event a receiver takes.

No model hub is needed: the tokenizer is a byte-level BPE trained on a few hundred generated
sentences with the ``tokenizers`` library and saved as a ``PreTrainedTokenizerFast`` (vLLM and
transformers load it with their ordinary loading code), and the model is a randomly initialised
``Qwen2ForCausalLM`` saved as safetensors. ``head_dim`` is fixed at 64 because vLLM's CPU
attention supports only a few head sizes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.common.messages import WeightsPublished

if TYPE_CHECKING:  # transformers is imported where used
    from transformers import PreTrainedTokenizerBase

    from streamrl.torchkit.weights.protocol import PublishedWeights

EOS_TOKEN = "<|endoftext|>"
HEAD_DIM = 64


def _corpus(num_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "the a one two three four five plus minus equals answer is what of number sum and or not yes no".split()
    return [
        " ".join(rng.choice(words) if rng.random() < 0.7 else str(rng.randint(0, 999)) for _ in range(12))
        for _ in range(num_lines)
    ]


def build_tokenizer(path: str | Path, vocab_size: int = 384, seed: int = 0) -> tuple[int, int]:
    """Train a byte-level BPE tokenizer, save it under ``path``; return (vocabulary size, eos id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(400, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.save_pretrained(str(path))
    return len(fast), fast.eos_token_id


def build_tiny_qwen2(
    path: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 384,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.1,
    seed: int = 0,
) -> Path:
    """Save a random Qwen2 model (float32) and its tokenizer under ``path``; return ``path``.

    ``hidden_size`` must be a multiple of 64 (heads of 64). Same arguments + seed = same weights.
    ``initializer_range`` is larger than Qwen2's 0.02 so that random logits are peaked enough for
    greedy decoding to be unambiguous between two implementations.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {HEAD_DIM} (vLLM CPU head sizes), got {hidden_size}")
    path = Path(path)
    actual_vocab, eos_id = build_tokenizer(path, vocab_size, seed)
    num_heads = hidden_size // HEAD_DIM
    config = Qwen2Config(
        vocab_size=actual_vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=initializer_range,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id)
    model.save_pretrained(str(path))
    return path


IMAGE_TOKEN = "<image>"
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""An image is one ``<image>`` in the template; the processor (and vLLM) expand it into the image's
tokens: ``<fake_token_around_image><global-img>``, ``<image>`` once per image embedding, then
``<fake_token_around_image>``."""


def build_tiny_idefics3(
    path: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    vision_layers: int = 2,
    vision_hidden_size: int = 64,
    image_size: int = 64,
    patch_size: int = 16,
    vocab_size: int = 384,
    initializer_range: float = 0.1,
    seed: int = 0,
) -> Path:
    """Save a random Idefics3-shaped vision-language model (float32: a SigLIP vision tower, a
    pixel-shuffle connector, a Llama language model) with its tokenizer, chat template and image
    processor under ``path`` (``AutoProcessor`` and vLLM load them); return ``path``.

    Every image is resized to ``image_size`` (no tiling) and becomes (image_size / patch_size / 2)^2
    ``<image>`` embeddings (4 by default). Idefics3 rather than Qwen2-VL or LLaVA: theirs need
    torchvision (transformers' processor, vLLM's model module), which has no working build beside
    this CPU torch. Same arguments + seed = same weights.
    """
    import torch
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    if hidden_size % HEAD_DIM or vision_hidden_size % HEAD_DIM:
        raise ValueError(
            f"hidden sizes must be multiples of {HEAD_DIM} (vLLM CPU head sizes), got "
            f"{hidden_size} and {vision_hidden_size}"
        )
    if image_size % (2 * patch_size):
        raise ValueError(f"image_size must be a multiple of 2 * patch_size, got {image_size} and {patch_size}")
    path = Path(path)
    build_tokenizer(path, vocab_size, seed)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    special = [
        "<|im_start|>",
        "<|im_end|>",
        "<fake_token_around_image>",
        IMAGE_TOKEN,
        "<global-img>",
        "<end_of_utterance>",
    ]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    eos_id = tokenizer.eos_token_id
    config = Idefics3Config(
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": hidden_size // HEAD_DIM,
            "num_key_value_heads": hidden_size // HEAD_DIM,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
            "initializer_range": initializer_range,
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
        },
        vision_config={
            "hidden_size": vision_hidden_size,
            "intermediate_size": 2 * vision_hidden_size,
            "num_hidden_layers": vision_layers,
            "num_attention_heads": vision_hidden_size // HEAD_DIM,
            "image_size": image_size,
            "patch_size": patch_size,
            "initializer_range": initializer_range,
        },
        image_token_id=_token_id(tokenizer, IMAGE_TOKEN),
        scale_factor=2,
        tie_word_embeddings=True,
        pad_token_id=eos_id,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    model.float()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id)
    model.save_pretrained(str(path))
    images = Idefics3ImageProcessor(
        do_image_splitting=False, size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size}
    )
    seq_len = (image_size // patch_size // 2) ** 2
    Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=seq_len, chat_template=VL_CHAT_TEMPLATE
    ).save_pretrained(str(path))
    return path


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of one token of ``tokenizer``'s vocabulary (``ValueError`` if it is not a single token)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise ValueError(f"{token!r} is not a single token of the tokenizer")
    return token_id


def weights_event(version: int, published: PublishedWeights | None = None, **fields: Any) -> WeightsPublished:
    """The (unsigned) event for ``version`` (step = version) of a publisher's ``published`` fields, or of
    ``fields`` alone (a ZMQ event without an endpoint by default)."""
    base: dict[str, Any] = {"checksum": "", "num_bytes": 0, "num_buckets": 0, "endpoint": ""}
    return WeightsPublished(version=version, step=version, batch_id="", **{**base, **(published or {}), **fields})
