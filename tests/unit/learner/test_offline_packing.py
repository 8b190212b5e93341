"""Packed rows give the same per-token log-probs and loss as one sample per row (tiny Qwen2, sdpa, fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from streamrl.learner.logprobs import IGNORE_INDEX, token_logprobs
from streamrl.learner.offline.losses import masked_nll
from streamrl.learner.packing import Sample, collate, pack_samples, sample_row


def _samples(n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(2, 9))]
        response = [rng.randrange(3, 259) for _ in range(rng.randint(1, 12))]
        out.append(Sample(prompt + response, [IGNORE_INDEX] * len(prompt) + response))
    return out


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    targets = batch.pop("targets")
    logprobs = token_logprobs(model(**batch, use_cache=False).logits, targets)
    return masked_nll(logprobs, targets != IGNORE_INDEX), logprobs[targets != IGNORE_INDEX]


def test_packed_equals_unpacked_loss(tiny_qwen_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    samples = _samples(10, seed=0)
    rows = pack_samples(samples, seq_len=32, pad_id=0)
    assert len(rows) < len(samples)  # several samples share a row
    with torch.no_grad():
        unpacked, unpacked_tokens = _loss(model, collate([sample_row(s) for s in samples], 0, packed=False))
        packed, packed_tokens = _loss(model, collate(rows, 0, packed=True))
    assert abs(packed.item() - unpacked.item()) < 1e-5
    # the same multiset of per-token log-probs (packing reorders samples)
    torch.testing.assert_close(packed_tokens.sort().values, unpacked_tokens.sort().values, atol=1e-5, rtol=0)


def test_packing_without_position_restarts_would_leak(tiny_qwen_dir: Path) -> None:
    """Guard that the test above can fail: plain causal attention over a packed row changes the loss."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    samples = _samples(10, seed=0)
    batch = collate(pack_samples(samples, seq_len=32, pad_id=0), 0, packed=True)
    with torch.no_grad():
        isolated, _ = _loss(model, dict(batch))
        batch["position_ids"] = torch.arange(32).expand_as(batch["position_ids"])
        leaky, _ = _loss(model, batch)
    assert abs(isolated.item() - leaky.item()) > 1e-3
