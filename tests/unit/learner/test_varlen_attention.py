"""Varlen attention: sequences laid end to end attend only within themselves, exactly as one by one;
a model with the varlen backend behaves like an sdpa one on forwards that pass no boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.learner.varlen_attention import padded_varlen_attention, register, varlen_kwargs


def test_padded_varlen_attention_equals_each_sequence_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 6, 4]
    n = sum(lengths)
    q = torch.randn(n, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(n, 2, 8, generator=gen, dtype=torch.float64),
        torch.randn(n, 2, 8, generator=gen, dtype=torch.float64),
    )
    cu = torch.tensor([0, 3, 4, 10, 14], dtype=torch.int32)
    out = padded_varlen_attention(q, k, v, cu, 6, scale=0.3)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1),
            k[a:b].repeat_interleave(2, 1).transpose(0, 1),
            v[a:b].repeat_interleave(2, 1).transpose(0, 1),
            is_causal=True,
            scale=0.3,
        ).transpose(0, 1)
        torch.testing.assert_close(out[a:b], alone)


def _models(tiny_qwen_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32, attn_implementation="sdpa")
    varlen = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32, attn_implementation=register())
    return sdpa.eval(), varlen.eval()


def test_a_flat_row_of_sequences_equals_each_sequence_alone(tiny_qwen_dir: Path) -> None:
    sdpa, varlen = _models(tiny_qwen_dir)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 259, (n,), generator=gen) for n in (5, 9, 2)]
    ids = torch.cat(seqs)[None, :]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None, :]
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    with torch.no_grad():
        flat = varlen.model(input_ids=ids, position_ids=positions, **varlen_kwargs(cu, 9, ids.device)).last_hidden_state
        alone = torch.cat([sdpa.model(input_ids=s[None, :]).last_hidden_state for s in seqs], dim=1)
    torch.testing.assert_close(flat, alone, rtol=1e-5, atol=1e-5)


def test_without_boundaries_the_varlen_backend_is_sdpa(tiny_qwen_dir: Path) -> None:
    sdpa, varlen = _models(tiny_qwen_dir)
    ids = torch.randint(3, 259, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    mask[2, 6:] = 0
    with torch.no_grad():
        torch.testing.assert_close(
            varlen(input_ids=ids, attention_mask=mask).logits, sdpa(input_ids=ids, attention_mask=mask).logits
        )


def test_sliding_windows_are_refused(tiny_qwen_dir: Path) -> None:
    _, varlen = _models(tiny_qwen_dir)
    layer = varlen.model.layers[0].self_attn
    layer.sliding_window = 4
    ids = torch.randint(3, 259, (1, 6))
    with pytest.raises(ValueError, match="sliding windows"):
        varlen.model(input_ids=ids, **varlen_kwargs(torch.tensor([0, 6]), 6, ids.device))
