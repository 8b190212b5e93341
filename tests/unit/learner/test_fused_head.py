"""Fused linear log-prob head: the same log-probs, entropies and gradients as full logits (CPU, float64),
and, on a GPU, the Triton kernels against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from streamrl.learner import head_kernels
from streamrl.learner.fused_head import fusable, linear_logprobs, linear_nll
from streamrl.learner.logprobs import IGNORE_INDEX, entropy, token_logprobs


def _inputs(n: int = 11, hidden: int = 6, vocab: int = 37, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[[2, 7]] = IGNORE_INDEX
    temperature = torch.rand(n, generator=gen, dtype=torch.float32) + 0.5
    return h, w, targets, temperature


def _reference(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> tuple:
    logits = (h @ w.t()) / temperature.to(h.dtype)[:, None]
    return token_logprobs(logits, targets), entropy(logits)


@pytest.mark.parametrize("chunk", [3, 4, 11, 64])
def test_logprobs_entropy_and_gradients_match_full_logits(chunk: int) -> None:
    h, w, targets, temperature = _inputs()
    gen = torch.Generator().manual_seed(5)
    g_lp, g_ent = torch.randn(targets.shape, generator=gen), torch.randn(targets.shape, generator=gen)
    grads = []
    for fused in (False, True):
        if fused:
            logp, ent = linear_logprobs(h, w, targets, temperature, with_entropy=True, chunk_tokens=chunk)
        else:
            logp, ent = _reference(h, w, targets, temperature)
        assert ent is not None
        assert logp.dtype == torch.float32 and logp[[2, 7]].abs().max() == 0
        h.grad = w.grad = None
        ((logp * g_lp).sum() + (ent * g_ent).sum()).backward()
        grads.append((logp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()))
    for ref, got in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(got.double(), ref.double(), rtol=1e-5, atol=1e-6)


def test_without_entropy_or_temperature() -> None:
    h, w, targets, _ = _inputs(seed=3)
    logp, ent = linear_logprobs(h, w, targets, chunk_tokens=5)
    assert ent is None
    torch.testing.assert_close(logp, token_logprobs(h @ w.t(), targets))
    logp.sum().backward()
    fused_grad = h.grad.clone()
    h.grad = None
    token_logprobs(h @ w.t(), targets).sum().backward()
    torch.testing.assert_close(fused_grad, h.grad)


@pytest.mark.parametrize("chunk", [4, 64])
def test_nll_and_its_forward_computed_gradient_match_full_logits(chunk: int) -> None:
    h, w, targets, _ = _inputs(seed=1)
    weights = torch.rand(targets.shape, generator=torch.Generator().manual_seed(2))
    loss, logp = linear_nll(h, w, targets, weights, chunk_tokens=chunk)
    assert not logp.requires_grad
    (3.0 * loss).backward()
    fused = (loss.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    ref_logp = token_logprobs(h @ w.t(), targets)
    ref = -(ref_logp * weights.double()).sum()
    (3.0 * ref).backward()
    torch.testing.assert_close(logp, ref_logp.float())
    for got, want in zip(fused, (ref.detach(), h.grad, w.grad), strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)


def test_nll_without_gradients_is_the_plain_value() -> None:
    h, w, targets, _ = _inputs(seed=4)
    weights = torch.ones(targets.shape)
    with torch.no_grad():
        loss, _ = linear_nll(h, w, targets, weights, chunk_tokens=4)
    torch.testing.assert_close(loss.double(), -token_logprobs(h @ w.t(), targets).double().sum())


def test_bad_shapes_and_chunks_are_refused() -> None:
    h, w, targets, _ = _inputs()
    with pytest.raises(ValueError, match="do not match"):
        linear_logprobs(h[:, :3], w, targets)
    with pytest.raises(ValueError, match="align"):
        linear_logprobs(h, w, targets[:3])
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_logprobs(h, w, targets, chunk_tokens=0)


def test_only_a_plain_bias_free_linear_head_is_fusable() -> None:
    assert fusable(torch.nn.Linear(4, 9, bias=False))
    assert not fusable(torch.nn.Linear(4, 9, bias=True))
    head = torch.nn.Linear(4, 9, bias=False)
    head.weight.ds_id = 3  # a ZeRO-3 partitioned parameter
    assert not fusable(head)


@pytest.mark.skipif(not torch.cuda.is_available() or head_kernels.triton is None, reason="Triton kernels need CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernels_match_the_torch_ops(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 33, 151_669
    z = (torch.randn(rows, vocab, generator=gen, device="cuda") * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen, device="cuda")
    targets[5] = IGNORE_INDEX
    inv_t = torch.rand(rows, generator=gen, device="cuda") + 0.5
    g_lp, g_ent = torch.randn(rows, generator=gen, device="cuda"), torch.randn(rows, generator=gen, device="cuda")
    stats = head_kernels._stats_triton(z, targets, inv_t, True)
    want = head_kernels._stats_torch(z, targets, inv_t, True)
    for got, ref in zip(stats, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    lse, _, ent = want
    got_grad = head_kernels._grad_triton(z.clone(), targets, inv_t, lse, g_lp, ent, g_ent)
    ref_grad = head_kernels._grad_torch(z.clone(), targets, inv_t, lse, g_lp, ent, g_ent)
    torch.testing.assert_close(got_grad.float(), ref_grad.float(), rtol=2e-2, atol=1e-5)
