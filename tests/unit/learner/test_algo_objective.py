"""The learner-facing composition: compute_advantages and policy_objective end to end."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.learner.rl.algo.config import AlgoConfig
from streamrl.learner.rl.algo.correction import token_divergence
from streamrl.learner.rl.algo.kl import kl_estimate
from streamrl.learner.rl.algo.losses import normaliser_count
from streamrl.learner.rl.algo.objective import compute_advantages, policy_objective

F64 = torch.float64


def cfg(**sections: object) -> AlgoConfig:
    return AlgoConfig.model_validate(sections)


# ---------------------------------------------------------------- compute_advantages


def test_every_estimator_hand_case() -> None:
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64), torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    m = mask.to(F64)
    expected = {
        "grpo": [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 0.0, 0.0],  # std_u = sqrt(0.5)
        "dr_grpo": [0.5, -0.5, 0.0, 0.0],
        "rloo": [1.0, -1.0, 0.0, 0.0],
        "flash_reinforce": [0.75, -0.25, -0.25, -0.25],
    }
    for estimator, per_seq in expected.items():
        adv, returns = compute_advantages(
            cfg(advantage={"estimator": estimator}), rewards=rewards, group_index=groups, mask=mask
        )
        assert returns is None
        assert torch.allclose(adv, torch.tensor(per_seq, dtype=F64)[:, None] * m), estimator
    # reinforce (no baseline): return-to-go = R on every token, whitened over the 7 tokens
    adv, _ = compute_advantages(
        cfg(advantage={"estimator": "reinforce"}), rewards=rewards, group_index=groups, mask=mask
    )
    mu, sd = 2 / 7, math.sqrt(2 / 7 - (2 / 7) ** 2)
    assert torch.allclose(adv[0], torch.tensor([(1 - mu) / sd] * 2, dtype=F64))
    assert torch.allclose(adv[1], torch.tensor([-mu / sd, 0.0], dtype=F64))
    # gae with V = 0 and gamma = lam = 1 gives the same whitened returns, and returns = R
    gae = cfg(advantage={"estimator": "gae"}, critic={})
    adv_gae, returns = compute_advantages(
        gae, rewards=rewards, group_index=groups, mask=mask, values=torch.zeros(4, 2, dtype=F64)
    )
    assert torch.allclose(adv_gae, adv)
    assert returns is not None and torch.allclose(returns, rewards[:, None] * m)


def test_kl_in_reward_shapes_per_token() -> None:
    rewards, groups = torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([3, 3])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 99.0]], dtype=F64)
    c = cfg(advantage={"estimator": "dr_grpo"}, kl={"placement": "reward", "coef": 0.5})
    adv, _ = compute_advantages(c, rewards=rewards, group_index=groups, mask=mask, kl=kl)
    # A[i,t] = s_i - 0.5 * sum_{k>=t} kl[i,k]
    assert torch.allclose(
        adv, torch.tensor([[0.5 - 0.3, 0.5 - 0.25, 0.5 - 0.15], [-0.5 - 0.45, -0.5 - 0.25, 0.0]], dtype=F64)
    )
    adv2, _ = compute_advantages(c, rewards=rewards, group_index=groups, mask=mask, kl=kl, kl_coef=0.0)
    assert torch.allclose(adv2, torch.tensor([[0.5] * 3, [-0.5, -0.5, 0.0]], dtype=F64))


def test_compute_advantages_errors() -> None:
    rewards, mask = torch.tensor([1.0, 0.0, 1.0]), torch.ones(3, 2)
    with pytest.raises(ValueError, match="at least 2 samples"):
        compute_advantages(cfg(), rewards=rewards, group_index=torch.tensor([0, 0, 1]), mask=mask)
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages(
            cfg(advantage={"estimator": "gae"}, critic={}),
            rewards=rewards,
            group_index=torch.zeros(3, dtype=torch.long),
            mask=mask,
        )
    with pytest.raises(ValueError, match="per-token kl"):
        compute_advantages(
            cfg(kl={"placement": "reward"}), rewards=rewards, group_index=torch.zeros(3, dtype=torch.long), mask=mask
        )
    with pytest.raises(ValueError, match="empty trajectory"):
        compute_advantages(
            cfg(advantage={"estimator": "flash_reinforce"}),
            rewards=rewards,
            group_index=torch.arange(3),
            mask=torch.tensor([[1, 1], [0, 0], [1, 0]]),
        )
    with pytest.raises(ValueError, match="expected rewards"):
        compute_advantages(cfg(), rewards=rewards[:2], group_index=torch.zeros(2, dtype=torch.long), mask=mask)


# ---------------------------------------------------------------- policy_objective


def batch(seed: int, B: int = 8, T: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1
    behaviour = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.05
    old = behaviour + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    return {
        "mask": mask,
        "behaviour_logprobs": behaviour,
        "old_logprobs": old,
        "logprobs": old + torch.randn(B, T, generator=g, dtype=F64) * 0.3,
        "ref_logprobs": old + torch.randn(B, T, generator=g, dtype=F64) * 0.2,
        "advantages": torch.randn(B, T, generator=g, dtype=F64),
        "entropy": torch.rand(B, T, generator=g, dtype=F64),
        "values": torch.randn(B, T, generator=g, dtype=F64),
        "old_values": torch.randn(B, T, generator=g, dtype=F64),
        "returns": torch.randn(B, T, generator=g, dtype=F64),
    }


CONFIGS = [
    cfg(
        kl={"placement": "loss", "estimator": "k3", "coef": 0.1},
        loss={"entropy_coef": 0.01},
        correction={"type": "icepop", "low": 0.8, "high": 1.25},
    ),
    cfg(
        loss={"policy_loss": "gspo", "aggregation": "seq-mean-token-mean", "clip_eps_low": 0.01, "clip_eps_high": 0.02},
        correction={"type": "seq_mask_tis", "low": 0.8, "high": 1.25},
    ),
    cfg(
        advantage={"estimator": "dr_grpo"},
        loss={"aggregation": "seq-mean-token-sum-norm", "norm_constant": 6, "dual_clip": 2.0},
        correction={"type": "tis"},
    ),
    cfg(
        advantage={"estimator": "gae"},
        critic={"value_clip": 0.2},
        loss={"aggregation": "seq-mean-token-sum"},
        correction={"type": "decoupled", "low": None, "high": 1.2},
    ),
    cfg(
        advantage={"estimator": "flash_reinforce"},
        loss={"aggregation": "seq-mean-token-mean"},
        correction={"type": "trust_gate", "gate_delta": 0.05},
    ),
]


def loss_and_grads(
    c: AlgoConfig, b: dict[str, torch.Tensor], rows: slice, normaliser: float
) -> tuple[torch.Tensor, ...]:
    logprobs = b["logprobs"][rows].clone().requires_grad_()
    values = b["values"][rows].clone().requires_grad_()
    entropy = b["entropy"][rows].clone().requires_grad_()
    kwargs = {k: v[rows] for k, v in b.items() if k not in ("logprobs", "values", "entropy")}
    loss, _ = policy_objective(c, logprobs=logprobs, values=values, entropy=entropy, normaliser=normaliser, **kwargs)
    loss.backward()
    return loss.detach(), logprobs.grad, values.grad, entropy.grad  # type: ignore[return-value]


@settings(max_examples=20, deadline=None)
@given(
    index=st.integers(0, len(CONFIGS) - 1),
    seed=st.integers(0, 10_000),
    cuts=st.lists(st.integers(1, 3), max_size=2, unique=True),
    world_size=st.sampled_from([1, 2]),
)
def test_split_invariance(index: int, seed: int, cuts: list[int], world_size: int) -> None:
    """Any micro-batch x rank split gives the full-batch loss and gradients (ranks average gradients)."""
    c, b = CONFIGS[index], batch(seed)
    B = b["mask"].shape[0]
    N = normaliser_count(b["mask"], c.loss.aggregation)
    full = loss_and_grads(c, b, slice(0, B), N)

    rank_size = B // world_size
    total_loss = torch.zeros((), dtype=F64)
    grads = [torch.zeros(B, b["mask"].shape[1], dtype=F64) for _ in range(3)]
    for rank in range(world_size):
        bounds = [0, *sorted(cuts), rank_size]
        for lo, hi in itertools.pairwise(bounds):
            rows = slice(rank * rank_size + lo, rank * rank_size + hi)
            loss, *micro_grads = loss_and_grads(c, b, rows, N / world_size)
            total_loss += loss / world_size  # the backend averages over ranks
            for acc, grad in zip(grads, micro_grads, strict=True):
                if grad is not None:
                    acc[rows] += grad / world_size
    assert torch.allclose(total_loss, full[0])
    for acc, grad in zip(grads, full[1:], strict=True):
        assert torch.allclose(acc, grad if grad is not None else torch.zeros_like(acc))


def test_loss_terms_add_up() -> None:
    b = batch(0)
    c = CONFIGS[0]
    N = normaliser_count(b["mask"], "token-mean")
    loss, metrics = policy_objective(
        c,
        normaliser=N,
        **{
            k: b[k]
            for k in ("logprobs", "old_logprobs", "behaviour_logprobs", "advantages", "mask", "ref_logprobs", "entropy")
        },
    )
    valid = b["mask"].bool()
    kl = kl_estimate(b["logprobs"], b["ref_logprobs"], "k3")
    assert metrics["learner/loss/kl"] == pytest.approx(0.1 * float(kl[valid].sum()) / N)
    assert metrics["learner/loss/entropy"] == pytest.approx(-0.01 * float(b["entropy"][valid].sum()) / N)
    parts = metrics["learner/loss/policy"] + metrics["learner/loss/kl"] + metrics["learner/loss/entropy"]
    assert float(loss) == pytest.approx(parts) and metrics["learner/loss/total"] == pytest.approx(parts)
    for name in (
        "learner/clip_frac",
        "learner/mismatch/kl",
        "learner/correction/masked_frac",
        "learner/kl_ref",
        "learner/entropy",
    ):
        assert name in metrics
    assert 0 < metrics["learner/correction/masked_frac"] < 1  # the tight [0.8, 1.25] band drops some tokens


def test_masked_token_stays_in_denominator() -> None:
    """An IcePop-rejected token contributes 0 but still counts in the token-mean normaliser."""
    logprobs = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    behaviour = torch.tensor([[0.0, -5.0]], dtype=F64)  # rho = 1 and e^5 (> 5: rejected)
    c = cfg(correction={"type": "icepop"})
    loss, metrics = policy_objective(
        c,
        logprobs=logprobs,
        old_logprobs=old,
        behaviour_logprobs=behaviour,
        advantages=torch.ones(1, 2, dtype=F64),
        mask=torch.ones(1, 2),
        normaliser=2,
    )
    assert float(loss.detach()) == pytest.approx(-0.5)
    assert metrics["learner/correction/masked_frac"] == 0.5
    assert metrics["learner/mismatch/kl"] == pytest.approx(-2.5)  # mean(log mu - log pi_old) = (0 - 5) / 2


def test_flash_reinforce_gradient_matches_reference() -> None:
    """FlashREINFORCE (algorithms.md 1.8d): L = -(1/B) sum_i (m_i A_i / T_i) sum_t sg(rho) logp."""
    g = torch.Generator().manual_seed(5)
    B, T, delta = 6, 5, 0.006
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1
    behaviour = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.05
    theta = behaviour + torch.randn(B, T, generator=g, dtype=F64) * 0.15
    rewards = torch.randn(B, generator=g, dtype=F64)
    c = cfg(
        advantage={"estimator": "flash_reinforce"},
        loss={"aggregation": "seq-mean-token-mean"},
        correction={"type": "trust_gate", "gate_delta": delta},
    )
    adv, _ = compute_advantages(c, rewards=rewards, group_index=torch.arange(B), mask=mask)
    logprobs = theta.clone().requires_grad_()
    loss, metrics = policy_objective(
        c,
        logprobs=logprobs,
        old_logprobs=theta,
        behaviour_logprobs=behaviour,
        advantages=adv,
        mask=mask,
        normaliser=normaliser_count(mask, "seq-mean-token-mean"),
    )
    loss.backward()

    ref_logprobs = theta.clone().requires_grad_()
    a = rewards - rewards.mean()
    ref = torch.zeros((), dtype=F64)
    kept = 0
    for i in range(B):
        pos = [j for j in range(T) if mask[i, j]]
        d = token_divergence(theta[i, pos], behaviour[i, pos], "binary_kl").mean()
        if d <= delta:
            kept += 1
            rho = torch.exp(theta[i, pos] - behaviour[i, pos])
            ref = ref - a[i] / len(pos) * (rho * ref_logprobs[i, pos]).sum() / B
    ref.backward()
    assert 0 < kept < B  # the gate is exercised both ways
    assert metrics["learner/correction/masked_frac"] > 0
    assert torch.allclose(logprobs.grad, ref_logprobs.grad)


def test_policy_objective_missing_inputs() -> None:
    b = batch(1)
    base = {k: b[k] for k in ("logprobs", "old_logprobs", "advantages", "mask")}
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_objective(cfg(correction={"type": "tis"}), normaliser=10, **base)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_objective(cfg(kl={"placement": "loss", "estimator": "k2"}), normaliser=10, **base)
    with pytest.raises(ValueError, match="entropy"):
        policy_objective(cfg(loss={"entropy_coef": 0.1}), normaliser=10, **base)
    with pytest.raises(ValueError, match="values"):
        policy_objective(cfg(advantage={"estimator": "gae"}, critic={}), normaliser=10, **base)
    with pytest.raises(ValueError, match="normaliser"):
        policy_objective(cfg(), normaliser=0, **base)
