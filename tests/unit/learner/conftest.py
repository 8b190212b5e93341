"""Fixtures for the learner's offline-job tests: a tiny Qwen2 causal LM with a byte tokenizer and ChatML template.

The model (hidden 64, 2 layers, 2 heads of 32, vocab 259) and tokenizer are built locally
under a session temp folder with the real ``save_pretrained`` code, so the loading path under
test is the one users run against hub models. Single-process DeepSpeed on CPU, float32.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_byte_tokenizer(out: Path) -> int:
    """A Qwen2-style byte-level BPE tokenizer without merges (one token per byte) + ChatML; returns its size.

    transformers 5 always loads a ``qwen2`` model folder's tokenizer as ``Qwen2Tokenizer`` (byte-level
    BPE), so the tiny tokenizer is one of those: 3 specials + 256 byte symbols = 259 ids.
    """
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS + alphabet)}
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return len(vocab)


def build_tiny_qwen2(out: Path, seed: int = 0) -> Path:
    """Save a randomly initialised tiny Qwen2 causal LM plus its byte tokenizer into ``out``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab_size = build_byte_tokenizer(out)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
    )
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny random Qwen2 causal LM and its byte tokenizer."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))
