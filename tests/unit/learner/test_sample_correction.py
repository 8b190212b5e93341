"""Per-sample correction figures (for the learner's training spans) are the micro-batch figures of
``policy_objective`` taken row by row: their token-weighted mean over the rows gives those back."""

from __future__ import annotations

import pytest
import torch

from streamrl.learner.rl.algo.config import AlgoConfig, CorrectionConfig
from streamrl.learner.rl.algo.objective import policy_objective, sample_correction


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq_mask_tis", "decoupled", "trust_gate"])
def test_token_weighted_mean_of_the_sample_figures_is_the_micro_batch_figure(kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(5, 9, generator=gen) * 3
    behaviour = old + torch.randn(5, 9, generator=gen) * 1.5  # ratios far from 1: some tokens corrected, some masked
    mask = (torch.rand(5, 9, generator=gen) < 0.8).float()
    mask[3] = 0.0  # a row with no valid token counts as nothing
    cfg = AlgoConfig(correction=CorrectionConfig(type=kind, low=0.5, high=2.0, gate_delta=0.05))
    _, metrics = policy_objective(
        cfg,
        logprobs=old.clone().requires_grad_(),
        old_logprobs=old,
        advantages=torch.ones(5, 9),
        mask=mask,
        normaliser=float(mask.sum()),
        behaviour_logprobs=behaviour,
    )

    weight, masked = sample_correction(cfg.correction, old_logprobs=old, behaviour_logprobs=behaviour, mask=mask)
    tokens = mask.sum(dim=1)
    assert weight.shape == masked.shape == (5,) and weight[3] == masked[3] == 0.0
    assert float((weight * tokens).sum() / tokens.sum()) == pytest.approx(metrics["learner/correction/weight_mean"])
    assert float((masked * tokens).sum() / tokens.sum()) == pytest.approx(metrics["learner/correction/masked_frac"])
    assert ((masked >= 0) & (masked <= 1)).all()


def test_rows_differ_where_their_tokens_were_treated_differently() -> None:
    old = torch.zeros(2, 4)
    behaviour = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -3.0, -3.0, 0.0]])  # row 1: two ratios e^3 > high
    mask = torch.ones(2, 4)
    weight, masked = sample_correction(
        CorrectionConfig(type="icepop", low=0.5, high=2.0), old_logprobs=old, behaviour_logprobs=behaviour, mask=mask
    )
    assert weight.tolist() == pytest.approx([1.0, 0.5]) and masked.tolist() == pytest.approx([0.0, 0.5])
