"""The loss mask of multi-turn episodes is honoured by every term of the loss and every metric.

Environment tokens (mask 0) sit inside the response, between the model's turns. For every policy
loss, aggregation and off-policy correction, with the KL in the loss and an entropy bonus on:

* the loss, its gradient and its metrics equal those of the same rows with the environment tokens
  removed (the single-turn computation is the reference), and
* whatever the environment positions hold (behaviour, old and reference log-probs, advantages,
  entropies, the log-probs themselves) changes neither the loss nor the gradient, which is exactly 0
  there.
"""

from __future__ import annotations

import pytest
import torch

from streamrl.learner.rl.algo.config import AlgoConfig
from streamrl.learner.rl.algo.kl import kl_estimate, sequence_mean_kl
from streamrl.learner.rl.algo.losses import normaliser_count
from streamrl.learner.rl.algo.objective import policy_objective, sample_correction

# three episodes: model turns (1) with environment tokens (0) between them, then padding (0)
MASK = torch.tensor(
    [
        [1, 1, 0, 0, 0, 1, 0, 0, 1, 1, 1],
        [1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
    ],
    dtype=torch.float32,
)
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
CORRECTIONS = ["none", "tis", "icepop", "seq_mask_tis", "decoupled", "trust_gate"]


def _cfg(policy_loss: str, aggregation: str, correction: str) -> AlgoConfig:
    loss = {
        "policy_loss": policy_loss,
        "aggregation": aggregation,
        "entropy_coef": 0.01,
        "dual_clip": 3.0,
        "norm_constant": 16.0 if aggregation == "seq-mean-token-sum-norm" else None,
    }
    if policy_loss == "gspo":
        loss |= {"clip_eps_low": 0.05, "clip_eps_high": 0.08}
    return AlgoConfig(
        advantage={"estimator": "reinforce"},
        kl={"placement": "loss", "estimator": "k3", "coef": 0.1},
        loss=loss,
        correction={"type": correction, "low": 0.8, "high": 1.25, "gate_delta": 0.02},
    )


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    """Random per-token inputs; the behaviour log-probs drift from pi_old by up to ~0.3 so that
    clipping, dual clipping and every correction's bounds and gates are exercised."""
    g = torch.Generator().manual_seed(seed)
    shape = MASK.shape
    logp = -torch.rand(shape, generator=g) * 3 - 0.05
    return {
        "logprobs": logp,
        "old_logprobs": logp + 0.3 * torch.randn(shape, generator=g),
        "behaviour_logprobs": logp + 0.3 * torch.randn(shape, generator=g),
        "ref_logprobs": logp + 0.5 * torch.randn(shape, generator=g),
        "advantages": torch.randn(shape, generator=g),
        "entropy": torch.rand(shape, generator=g) * 2,
    }


def _loss(cfg: AlgoConfig, mask: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict, dict]:
    """The loss, its metrics, and the gradients of the log-probs and entropies."""
    leaves = {k: x[k].clone().requires_grad_(True) for k in ("logprobs", "entropy")}
    normaliser = float(normaliser_count(mask, cfg.loss.aggregation))
    loss, metrics = policy_objective(cfg, mask=mask, normaliser=normaliser, **{**x, **leaves})
    loss.backward()
    return loss.detach(), metrics, {k: v.grad for k, v in leaves.items()}


def _compress(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's model-token entries laid end to end (environment tokens removed), zero-padded."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        kept = x[i][mask[i].bool()]
        out[i, : kept.numel()] = kept
    return out


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_environment_tokens_reach_neither_loss_nor_gradient(
    policy_loss: str, aggregation: str, correction: str
) -> None:
    cfg = _cfg(policy_loss, aggregation, correction)
    x = _inputs(seed=len(aggregation) + len(correction))
    loss, metrics, grads = _loss(cfg, MASK, x)
    assert metrics["learner/tokens"] == float(MASK.sum())

    # reference: the same episodes without their environment tokens
    packed = _compress(MASK, MASK)
    ref_loss, ref_metrics, ref_grads = _loss(cfg, packed, {k: _compress(v, MASK) for k, v in x.items()})
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    assert metrics.keys() == ref_metrics.keys()
    for k in metrics:
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-7), k
    for k in grads:
        torch.testing.assert_close(_compress(grads[k], MASK), ref_grads[k], rtol=1e-6, atol=1e-8)
        assert bool((grads[k][MASK == 0] == 0).all()), k

    # anything at the environment positions: the same loss, gradient and metrics, bit for bit
    env = MASK == 0
    g = torch.Generator().manual_seed(1)
    noisy = {k: torch.where(env, v + 15.0 * torch.randn(v.shape, generator=g), v) for k, v in x.items()}
    loss2, metrics2, grads2 = _loss(cfg, MASK, noisy)
    assert torch.equal(loss2, loss) and metrics2 == metrics
    for k in grads:
        assert torch.equal(grads2[k], grads[k]), k

    if correction != "none":  # the per-sample figures of the learner's traces
        figures = sample_correction(
            cfg.correction, old_logprobs=x["old_logprobs"], behaviour_logprobs=x["behaviour_logprobs"], mask=MASK
        )
        figures2 = sample_correction(
            cfg.correction,
            old_logprobs=noisy["old_logprobs"],
            behaviour_logprobs=noisy["behaviour_logprobs"],
            mask=MASK,
        )
        assert all(torch.equal(a, b) for a, b in zip(figures, figures2, strict=True))


def test_the_adaptive_kl_sees_model_tokens_only() -> None:
    x = _inputs(seed=5)
    kl = kl_estimate(x["old_logprobs"], x["ref_logprobs"], "k1") * MASK  # as the trainer builds it
    packed = _compress(kl, MASK)
    assert float(sequence_mean_kl(kl, MASK)) == pytest.approx(float(sequence_mean_kl(packed, _compress(MASK, MASK))))
    noisy_ref = torch.where(MASK == 0, x["ref_logprobs"] - 9.0, x["ref_logprobs"])
    assert torch.equal(kl_estimate(x["old_logprobs"], noisy_ref, "k1") * MASK, kl)
