"""A tiny random Qwen2 checkpoint with a locally trained tokenizer, for tests and CPU demos.

No model hub is needed: the tokenizer is a byte-level BPE trained on a few hundred generated
sentences with the ``tokenizers`` library and saved as a ``PreTrainedTokenizerFast`` (vLLM and
transformers load it with their ordinary loading code), and the model is a randomly initialised
``Qwen2ForCausalLM`` saved as safetensors. ``head_dim`` is fixed at 64 because vLLM's CPU
attention supports only a few head sizes.
"""

from __future__ import annotations

import random
from pathlib import Path

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
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id)
    model.save_pretrained(str(path))
    return path
