"""Fixtures of the learner's tests (unit and integration): a tiny Qwen2 causal LM with a byte tokenizer and ChatML.

The model (hidden 64, 2 layers, 2 heads of 32, vocab 259) and tokenizer are built locally
under a session temp folder with the real ``save_pretrained`` code, so the loading path under
test is the one users run against hub models. Single-process DeepSpeed on CPU, float32.
The conftest.py of tests/unit/learner and of tests/integration/learner import the fixtures from here.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


ANIMALS = {"a": "ant", "b": "bee", "c": "cat", "d": "dog", "e": "eel", "f": "fox"}


def animal_records(n: int, seed: int) -> list[dict[str, Any]]:
    """The tiny SFT task: the prompt is a letter followed by noise, the answer the animal of that letter."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        letter = rng.choice(sorted(ANIMALS))
        noise = "".join(rng.choice("0123456789") for _ in range(rng.randint(0, 3)))
        out.append({"prompt": letter + noise, "response": ANIMALS[letter]})
    return out


def preference_records(n: int, seed: int) -> list[dict[str, Any]]:
    """A synthetic preference: responses made of a-e are preferred over responses made of v-z."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = "".join(rng.choice("klmn") for _ in range(rng.randint(2, 4)))
        good = "".join(rng.choice("abcde") for _ in range(rng.randint(3, 6)))
        bad = "".join(rng.choice("vwxyz") for _ in range(rng.randint(3, 6)))
        out.append({"prompt": prompt, "chosen": good, "rejected": bad})
    return out


def offline_recipe(
    run_dir: Path, model_dir: Path, train_path: Path, eval_path: Path | None, **sections: Any
) -> dict[str, Any]:
    """A job config dict for CPU tests: ZeRO-0 fp32, no TensorBoard, no progress bar."""
    cfg: dict[str, Any] = {
        "model": {"path": str(model_dir)},
        "data": {"train_path": str(train_path), "eval_path": str(eval_path) if eval_path else None, "max_len": 64},
        "train": {"run_dir": str(run_dir)},
        "deepspeed": {"zero_stage": 0, "dtype": "fp32", "lr": 3e-3, "scheduler": "constant", "micro_batch_size": 8},
        "logging": {"tensorboard": False, "progress": False},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    return cfg


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The data helpers above, as a fixture (test modules never import a conftest: its module name is not unique)."""
    return SimpleNamespace(
        write_jsonl=write_jsonl,
        animal_records=animal_records,
        preference_records=preference_records,
        recipe=offline_recipe,
    )
