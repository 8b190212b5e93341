"""KL estimators and controllers: hand values, clamps, gradients, exact expectations."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.learner.rl.algo.kl import KLController, adaptive_kl_coef, kl_estimate, sequence_mean_kl

F64 = torch.float64


def test_hand_values() -> None:
    logp, ref = torch.tensor([-1.0, -2.0], dtype=F64), torch.tensor([-2.0, -1.0], dtype=F64)  # Delta = +1, -1
    assert torch.allclose(kl_estimate(logp, ref, "k1"), torch.tensor([1.0, -1.0], dtype=F64))
    assert torch.allclose(kl_estimate(logp, ref, "k2"), torch.tensor([0.5, 0.5], dtype=F64))
    k3 = torch.tensor([math.exp(-1) - 1 + 1, math.exp(1) - 1 - 1], dtype=F64)
    assert torch.allclose(kl_estimate(logp, ref, "k3"), k3)
    assert torch.allclose(kl_estimate(logp, ref, "k3+"), k3)


def test_clamps() -> None:
    logp, ref = torch.tensor([0.0, -50.0], dtype=F64), torch.tensor([-50.0, 0.0], dtype=F64)  # Delta = 50, -50
    assert kl_estimate(logp, ref, "k1").tolist() == [10.0, -10.0]
    assert kl_estimate(logp, ref, "k2").tolist() == [10.0, 10.0]
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(k3).all() and k3.tolist() == [10.0, 10.0]
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_gradients() -> None:
    ref = torch.tensor([-1.3, -0.2, -2.0], dtype=F64)
    for estimator, grad_of_delta in [
        ("k1", lambda d: torch.ones_like(d)),
        ("k2", lambda d: d),
        ("k3", lambda d: 1 - torch.exp(-d)),
        ("k3+", lambda d: d),  # straight-through: k2's gradient
    ]:
        logp = torch.tensor([-1.0, -0.5, -1.5], dtype=F64, requires_grad=True)
        kl_estimate(logp, ref, estimator).sum().backward()  # type: ignore[arg-type]
        assert torch.allclose(logp.grad, grad_of_delta(logp.detach() - ref)), estimator


def test_exact_expectations_on_a_categorical() -> None:
    """E_{y~q}[k1] = E_{y~q}[k3] = KL(q || p) exactly; k2, k3 >= 0 pointwise."""
    g = torch.Generator().manual_seed(0)
    logq = torch.log_softmax(torch.randn(50, generator=g, dtype=F64) * 0.5, dim=0)
    logp = torch.log_softmax(torch.randn(50, generator=g, dtype=F64) * 0.5, dim=0)
    assert kl_estimate(logq, logp, "k3").max() < 10  # the [-10, 10] clamp (a bias) is not active here
    q = logq.exp()
    kl = float((q * (logq - logp)).sum())
    assert float((q * kl_estimate(logq, logp, "k1")).sum()) == pytest.approx(kl, rel=1e-10)
    assert float((q * kl_estimate(logq, logp, "k3")).sum()) == pytest.approx(kl, rel=1e-10)
    assert (kl_estimate(logq, logp, "k2") >= 0).all() and (kl_estimate(logq, logp, "k3") >= 0).all()


def test_sequence_mean_kl() -> None:
    kl = torch.tensor([[1.0, 3.0, 9.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert float(sequence_mean_kl(kl, mask)) == pytest.approx((2.0 + 4.0) / 2)
    with pytest.raises(ValueError):
        sequence_mean_kl(kl, torch.zeros_like(mask))


def test_adaptive_controller() -> None:
    assert adaptive_kl_coef(0.1, current_kl=0.2, target=0.1, n_steps=100, horizon=1000) == pytest.approx(0.102)
    assert adaptive_kl_coef(0.1, current_kl=0.05, target=0.1, n_steps=100, horizon=1000) == pytest.approx(0.098)
    assert adaptive_kl_coef(0.1, current_kl=0.11, target=0.1, n_steps=100, horizon=1000) == pytest.approx(0.1 * 1.01)
    fixed = KLController(0.01)
    assert fixed.update(5.0, 100) == 0.01
    adaptive = KLController(0.1, target=0.1, horizon=1000)
    adaptive.update(0.2, 100)
    assert adaptive.update(0.2, 100) == pytest.approx(0.1 * 1.02**2)
    with pytest.raises(ValueError):
        adaptive_kl_coef(0.1, 0.1, target=0.0, n_steps=1, horizon=1)
