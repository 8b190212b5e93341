"""bench/gpu_vllm.py's reference log-probs, on the CPU (the vLLM kit's installer script: tests/integration/gpu)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_reference_logprobs_are_the_tempered_log_softmax(tmp_path: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = importlib.util.spec_from_file_location("gpu_vllm", ROOT / "bench" / "gpu_vllm.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["gpu_vllm"] = bench
    spec.loader.exec_module(bench)
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
    )
    model = Qwen2ForCausalLM(config).eval()
    prompt, tokens = [3, 4, 5], [6, 7]
    got = bench.reference_logprobs(model, prompt, tokens, temperature=0.5)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    want = [torch.log_softmax(logits[2 + i] / 0.5, -1)[t].item() for i, t in enumerate(tokens)]
    assert got == pytest.approx(want, abs=1e-6)
