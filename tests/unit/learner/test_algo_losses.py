"""Policy / value losses and aggregation: hand vectors, loop references, split invariance."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.learner.rl.algo.losses import (
    aggregate,
    entropy_from_logits,
    gspo_loss,
    normaliser_count,
    ppo_clip_loss,
    value_loss,
)

F64 = torch.float64


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def test_ppo_hand_vectors_and_gradients() -> None:
    ratios = [1.5, 0.5, 0.5, 1.5, 1.25]
    advs = [1.0, 1.0, -1.0, -1.0, 1.0]
    logp = torch.log(t(ratios)).requires_grad_()
    out = ppo_clip_loss(logp, torch.zeros(5, dtype=F64), t(advs), eps_low=0.2, eps_high=0.28)
    # r=1.5,A=1 -> -1.28 (clipped); r=.5,A=1 -> -.5; r=.5,A=-1 -> .8 (clipped); r=1.5,A=-1 -> 1.5; r=1.25 in range
    assert torch.allclose(out.loss, t([-1.28, -0.5, 0.8, 1.5, -1.25]))
    assert out.clipped.tolist() == [True, False, True, False, False]
    out.loss.sum().backward()
    # d(-r A)/d logp = -r A where unclipped, 0 where the clipped branch is active
    assert torch.allclose(logp.grad, t([0.0, -0.5, 0.0, 1.5, -1.25]))


def test_dual_clip() -> None:
    logp = torch.log(t([5.0, 2.0, 5.0])).requires_grad_()
    out = ppo_clip_loss(logp, torch.zeros(3, dtype=F64), t([-1.0, -1.0, 1.0]), dual_clip=3.0)
    assert torch.allclose(out.loss, t([3.0, 2.0, -1.2]))
    assert out.dual_clipped.tolist() == [True, False, False]
    out.loss.sum().backward()
    assert torch.allclose(logp.grad, t([0.0, 2.0, 0.0]))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, torch.zeros(3, dtype=F64), t([-1.0, -1.0, 1.0]), dual_clip=1.0)


def test_ppo_matches_scalar_reference_with_dual_clip_identity() -> None:
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(200, generator=g, dtype=F64) * 0.5, torch.randn(200, generator=g, dtype=F64) * 0.5
    adv = torch.randn(200, generator=g, dtype=F64)
    el, eh, c = 0.2, 0.28, 3.0
    out = ppo_clip_loss(logp, old, adv, eps_low=el, eps_high=eh, dual_clip=c)
    for lp, lo, a, got in zip(logp.tolist(), old.tolist(), adv.tolist(), out.loss.tolist(), strict=True):
        r = math.exp(lp - lo)
        expected = -min(r * a, min(max(r, 1 - el), 1 + eh) * a)
        if a < 0:
            expected = min(expected, -c * a)
            assert expected == pytest.approx(abs(a) * min(max(r, 1 - el), c))  # algorithms.md 3.2 identity
        assert got == pytest.approx(expected, abs=1e-12)


def test_ratio_log_clamp() -> None:
    out = ppo_clip_loss(t([0.0]), t([-100.0]), t([-1.0]))
    assert torch.isfinite(out.loss).all() and float(out.ratio) == pytest.approx(math.exp(20))


def test_gspo_gradient_equals_sequence_objective() -> None:
    """With seq-mean-token-mean and per-sequence advantages, GSPO-token = the paper's sequence objective."""
    g = torch.Generator().manual_seed(1)
    B, T = 4, 6
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1
    old = torch.randn(B, T, generator=g, dtype=F64) * 0.1
    logp = (old + torch.randn(B, T, generator=g, dtype=F64) * 0.05).requires_grad_()
    adv_seq = t([1.0, -1.0, 0.5, -2.0])
    adv = adv_seq[:, None].expand(B, T)
    out = gspo_loss(logp, old, adv, mask, eps_low=0.003, eps_high=0.004)
    loss = aggregate(out.loss, mask, "seq-mean-token-mean", normaliser=B)
    (grad,) = torch.autograd.grad(loss, logp)

    logp2 = logp.detach().clone().requires_grad_()
    m = mask.to(F64)
    s = torch.exp(((logp2 - old) * m).sum(1) / m.sum(1))
    ref = -torch.minimum(s * adv_seq, torch.clamp(s, 1 - 0.003, 1 + 0.004) * adv_seq).mean()
    (grad_ref,) = torch.autograd.grad(ref, logp2)
    assert torch.allclose(loss, ref)
    assert torch.allclose(grad, grad_ref)


def test_value_loss_hand() -> None:
    values, old, returns = t([1.0, 0.2, 1.0]), t([0.0, 0.0, 0.0]), t([0.0, 1.0, 2.0])
    loss, clipped = value_loss(values, old, returns, clip_eps=0.5)
    assert torch.allclose(loss, t([0.5, 0.32, 1.125]))
    assert clipped.tolist() == [False, False, True]
    loss, clipped = value_loss(values, old, returns, clip_eps=None)
    assert torch.allclose(loss, t([0.5, 0.32, 0.5])) and not clipped.any()


def test_entropy_from_logits() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    p = torch.softmax(logits[2].double(), 0)
    expected = [math.log(4), 0.0, float(-(p * p.log()).sum())]
    assert torch.allclose(entropy_from_logits(logits), torch.tensor(expected, dtype=torch.float32), atol=1e-5)


def test_aggregate_hand_and_nan_padding() -> None:
    nan = float("nan")
    per_token, mask = (
        t([[1.0, 2.0, 3.0], [4.0, nan, nan], [nan, nan, nan]]),
        torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]]),
    )
    assert normaliser_count(mask, "token-mean") == 4
    assert normaliser_count(mask, "seq-mean-token-mean") == 2  # the empty row does not count
    assert float(aggregate(per_token, mask, "token-mean", 4)) == pytest.approx(2.5)
    assert float(aggregate(per_token, mask, "seq-mean-token-mean", 2)) == pytest.approx(3.0)
    assert float(aggregate(per_token, mask, "seq-mean-token-sum", 2)) == pytest.approx(5.0)
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm", 2, constant=10)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="constant"):
        aggregate(per_token, mask, "seq-mean-token-sum-norm", 2)
    with pytest.raises(ValueError, match="normaliser"):
        aggregate(per_token, mask, "token-mean", 0)


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@settings(max_examples=25, deadline=None)
@given(
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 10_000),
    cuts=st.lists(st.integers(1, 9), min_size=0, max_size=4, unique=True),
)
def test_aggregate_split_invariance(mode: str, seed: int, cuts: list[int]) -> None:
    """Summing micro-batch aggregates with the global normaliser equals the full-batch aggregate."""
    g = torch.Generator().manual_seed(seed)
    B, T = 10, 5
    per_token = torch.randn(B, T, generator=g, dtype=F64)
    mask = (torch.rand(B, T, generator=g) > 0.4).long()
    mask[0, 0] = 1
    bounds = [0, *sorted(cuts), B]
    chunks = [slice(a, b) for a, b in itertools.pairwise(bounds)]
    normaliser = sum(normaliser_count(mask[c], mode) for c in chunks)  # type: ignore[arg-type]
    full = aggregate(per_token, mask, mode, normaliser, constant=7)  # type: ignore[arg-type]
    parts = sum(aggregate(per_token[c], mask[c], mode, normaliser, constant=7) for c in chunks)  # type: ignore[arg-type]
    assert torch.allclose(full, parts)
