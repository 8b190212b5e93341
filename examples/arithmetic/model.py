"""Tiny Llama policy and character-level tokenizer for the arithmetic task, built locally (no hub).

The output folder is a normal Hugging Face model folder (config, safetensors, tokenizer files), so
transformers, TRL and vLLM load it by path, exactly as they would load a hub model. Llama rather
than Qwen2: transformers 5 forces its byte-level Qwen2 tokenizer class onto any ``qwen2`` folder,
which would re-split these characters; a ``llama`` folder keeps the saved tokenizer as it is.

Tokenizer: one token per character of ``"0123456789+-*=,#"`` plus ``<pad>`` (id 0), ``<s>`` and
``</s>``. Nothing is added automatically when encoding (no BOS): a prompt encodes to the same ids in
transformers, TRL and vLLM, and the policy learns to end its answer with ``</s>``.

Presets (vLLM's CPU attention needs head_dim in {32, 64, 80, ...}, so hidden = 64 x heads):

* ``small`` (workload a): hidden 128, 2 heads, 4 layers, MLP 256 -> 0.66M parameters.
* ``large`` (workload b, generation-heavy): hidden 512, 8 heads, 8 layers, MLP 1536 -> 27M.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

CHARS = "0123456789+-*=,#"
PAD, BOS, EOS = "<pad>", "<s>", "</s>"


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the tiny Llama policy."""

    hidden_size: int
    """Width; a multiple of 64 (head_dim is 64)."""
    num_layers: int
    """Transformer blocks."""
    intermediate_size: int
    """MLP width."""
    max_positions: int
    """Longest prompt + response, in tokens."""

    def __post_init__(self) -> None:
        if self.hidden_size % 64 != 0 or self.hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive multiple of 64 (head_dim 64), got {self.hidden_size}")
        if self.num_layers < 1 or self.intermediate_size < 1 or self.max_positions < 8:
            raise ValueError(f"bad model shape: {self}")


PRESETS = {
    "small": ModelSpec(hidden_size=128, num_layers=4, intermediate_size=256, max_positions=64),
    "large": ModelSpec(hidden_size=512, num_layers=8, intermediate_size=1536, max_positions=256),
}


def build_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: every character of ``chars`` (default :data:`CHARS`) is one token."""
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=PAD,
        padding_side="left",
    )


def build_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised fp32 Llama with ``spec``'s shape and the tokenizer's special ids."""
    num_heads = spec.hidden_size // 64
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=spec.max_positions,
        # Untied: the vocabulary is tiny, and separate weights avoid the CPU engine's tied-head pitfall.
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model


def num_parameters(model: torch.nn.Module) -> int:
    """Total parameter count."""
    return sum(p.numel() for p in model.parameters())


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: str | Path) -> None:
    """Write the model (safetensors) and tokenizer into ``folder``."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
