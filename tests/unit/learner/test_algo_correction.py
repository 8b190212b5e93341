"""Off-policy corrections: hand vectors, NaN guards, a sequence-level loop reference, mismatch metrics."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.learner.rl.algo import correction as corr_fns

F64 = torch.float64


def logs(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, behaviour) log-probs whose ratio pi_old / mu is ``ratios``."""
    behaviour = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=F64)
    return behaviour + torch.log(torch.tensor(ratios, dtype=F64)), behaviour


def test_tis_two_sided_and_one_sided() -> None:
    old, behaviour = logs([[0.25, 1.0, 10.0]])
    mask = torch.ones(1, 3)
    out = corr_fns.tis(old, behaviour, mask, low=0.5, high=5.0)
    assert torch.allclose(out.weights, torch.tensor([[0.5, 1.0, 5.0]], dtype=F64))
    assert out.truncated.tolist() == [[True, False, True]] and out.kept.all()
    out = corr_fns.tis(old, behaviour, mask, low=None, high=5.0)
    assert torch.allclose(out.weights, torch.tensor([[0.25, 1.0, 5.0]], dtype=F64))
    assert out.truncated.tolist() == [[False, False, True]]


def test_icepop_inclusive_bounds() -> None:
    old, behaviour = logs([[0.5, 5.0, 0.49, 5.01, 1.0]])
    rho = torch.exp(old - behaviour)
    low, high = float(rho[0, 0]), float(rho[0, 1])  # ~0.5 and ~5.0, exactly as the function sees them
    out = corr_fns.icepop(old, behaviour, torch.ones(1, 5), low=low, high=high)
    assert torch.allclose(out.weights, torch.tensor([[0.5, 5.0, 0.0, 0.0, 1.0]], dtype=F64))
    assert out.kept.tolist() == [[True, True, False, False, True]]
    out = corr_fns.decoupled(old, behaviour, torch.ones(1, 5), low=None, high=high)  # AReaL cap: upper bound only
    assert out.kept.tolist() == [[True, True, True, False, True]]


def test_overflowed_ratio_and_nan_padding_give_zero_not_nan() -> None:
    old = torch.tensor([[-1.0, -1.0, float("nan")]], dtype=F64)
    behaviour = torch.tensor([[float("-inf"), -1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    for out in (corr_fns.icepop(old, behaviour, mask, 0.5, 5.0), corr_fns.seq_mask_tis(old, behaviour, mask, 0.5, 5.0)):
        assert torch.isfinite(out.weights).all()
        assert out.weights[0, 0] == 0 and out.weights[0, 2] == 0
    out = corr_fns.tis(old, behaviour, mask, 0.5, 5.0)
    assert out.weights.tolist() == [[5.0, 1.0, 0.0]]


def test_seq_mask_tis_hand() -> None:
    old, behaviour = logs([[2.0, 0.5, 1e6], [8.0, 4.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the padded 1e6 must not enter the geometric mean
    out = corr_fns.seq_mask_tis(old, behaviour, mask, low=0.5, high=5.0)
    # row 0: geo mean 1 -> kept, token weights NOT truncated; row 1: geo mean sqrt(32) > 5 -> dropped
    assert torch.allclose(out.weights, torch.tensor([[2.0, 0.5, 0.0], [0.0, 0.0, 0.0]], dtype=F64))
    assert out.kept.tolist() == [[True, True, False], [False, False, False]]


def test_seq_mask_tis_matches_loop_reference() -> None:
    g = torch.Generator().manual_seed(3)
    B, T = 8, 6
    behaviour = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old = behaviour + torch.randn(B, T, generator=g, dtype=F64) * 0.8
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1
    out = corr_fns.seq_mask_tis(old, behaviour, mask, low=0.7, high=1.4)
    for i in range(B):
        pos = [j for j in range(T) if mask[i, j]]
        geo = math.exp(sum(float(old[i, j] - behaviour[i, j]) for j in pos) / len(pos))
        keep = 0.7 <= geo <= 1.4
        for j in range(T):
            expected = math.exp(float(old[i, j] - behaviour[i, j])) if keep and j in pos else 0.0
            assert float(out.weights[i, j]) == pytest.approx(expected, rel=1e-12)


def test_trust_gate_binary_kl_and_tv() -> None:
    p, q = 0.5, 0.25
    d = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    behaviour, logprobs = torch.tensor([[math.log(p)]], dtype=F64), torch.tensor([[math.log(q)]], dtype=F64)
    assert float(corr_fns.token_divergence(logprobs, behaviour, "binary_kl")) == pytest.approx(d)
    assert float(corr_fns.token_divergence(logprobs, behaviour, "tv")) == pytest.approx(0.25)
    # row 0 diverges (mean d/2 over its two tokens), row 1 is identical to the engine
    logprobs = torch.tensor([[math.log(q), math.log(0.5)], [math.log(0.3), math.log(0.9)]], dtype=F64)
    behaviour = torch.tensor([[math.log(p), math.log(0.5)], [math.log(0.3), math.log(0.9)]], dtype=F64)
    mask = torch.ones(2, 2)
    out = corr_fns.trust_gate(logprobs, behaviour, mask, delta=d / 2)
    assert out.kept.all()  # the gate is inclusive: Dbar_0 = d/2 <= delta
    assert torch.allclose(out.weights, torch.tensor([[0.5, 1.0], [1.0, 1.0]], dtype=F64))
    out = corr_fns.trust_gate(logprobs, behaviour, mask, delta=d / 2 - 1e-9)
    assert out.kept.tolist() == [[False, False], [True, True]]
    out = corr_fns.trust_gate(logprobs, behaviour, mask, delta=0.1, metric="tv")  # TV mean of row 0 = 0.125
    assert out.kept.tolist() == [[False, False], [True, True]]
    assert corr_fns.trust_gate(logprobs, behaviour, mask, delta=0.125, metric="tv").kept.all()


def test_mismatch_kl() -> None:
    old, behaviour = logs([[2.0, 0.5, 123.0]])
    mask = torch.tensor([[1, 1, 0]])
    k1, k3 = corr_fns.mismatch_kl(old, behaviour, mask)
    assert float(k1) == pytest.approx((-math.log(2) - math.log(0.5)) / 2)
    assert float(k3) == pytest.approx(((2 - 1 - math.log(2)) + (0.5 - 1 - math.log(0.5))) / 2)
    k1, k3 = corr_fns.mismatch_kl(behaviour, behaviour, mask)
    assert float(k1) == 0.0 and float(k3) == 0.0
