"""On a CUDA GPU: torch's flash varlen attention, the liger kernels and the fused head give the numbers
of the padded sdpa model through full logits, to bf16 rounding (skipped without CUDA)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.kernels import apply_kernels
from streamrl.learner.lm_forward import rows_logprobs, rows_nll
from streamrl.learner.logprobs import IGNORE_INDEX, token_logprobs
from streamrl.learner.packing import Sample, collate, pack_samples, sample_row
from streamrl.learner.varlen_attention import _flash, padded_varlen_attention, register

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_flash_varlen_matches_padded_sdpa_forward_and_backward() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [700, 1, 129, 2048, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    n = sum(lengths)
    q = torch.randn(n, 14, 64, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k = torch.randn(n, 2, 64, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    v = torch.randn(n, 2, 64, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    g = torch.randn(n, 14, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    results = []
    for attend in (
        lambda: _flash(q, k, v, cu, max(lengths), 0.125),
        lambda: padded_varlen_attention(q.float(), k.float(), v.float(), cu, max(lengths), 0.125),
    ):
        q.grad = k.grad = v.grad = None
        out = attend()
        (out.float() * g).sum().backward()
        results.append([out.float(), q.grad.float(), k.grad.float(), v.grad.float()])
    for got, ref in zip(*results, strict=True):
        assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max()) + 1e-2


def _samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in (40, 7, 120, 64, 33, 90):
        ids = torch.randint(3, 259, (n,), generator=gen).tolist()
        out.append(Sample(ids, [IGNORE_INDEX] * (n // 4) + ids[n // 4 :]))
    return out


def test_the_fast_learner_path_matches_the_padded_model(tiny_qwen_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.qwen2 import modeling_qwen2

    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):  # the rotary wrapper stays process-wide: restore
        monkeypatch.setattr(modeling_qwen2, name, getattr(modeling_qwen2, name))
    samples = _samples()
    batch = collate([sample_row(s) for s in samples], pad_id=0, packed=False)
    targets = batch.pop("targets").cuda()
    reference = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    with torch.no_grad():  # before the liger patches, which replace module-level functions of the model type
        ref = token_logprobs(reference.cuda()(**{k: v.cuda() for k, v in batch.items()}).logits, targets)
    fast = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.bfloat16, attn_implementation=register())
    fast.config.use_cache = False
    if importlib.util.find_spec("liger_kernel") is not None:
        assert apply_kernels(fast, "liger")
    fast = fast.cuda()
    cfg = DeepSpeedConfig(head_chunk_tokens=100)
    with torch.no_grad():
        logp, mask = rows_logprobs(fast, [sample_row(s) for s in samples], cfg)
        loss, tokens = rows_nll(fast, pack_samples(samples, 160, pad_id=0), cfg)
    valid = targets != IGNORE_INDEX
    assert torch.equal(mask, valid) and tokens == int(valid.sum())
    assert float((logp - ref)[valid].abs().mean()) < 0.02
    assert abs(float(loss) + float(ref[valid].mean())) < 0.02
