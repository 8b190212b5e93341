"""Pure maths of the offline stages: losses, log-probs, packing layout."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.learner.logprobs import IGNORE_INDEX, entropy, shift_targets, token_logprobs
from streamrl.learner.offline.losses import bradley_terry_loss, masked_nll, preference_loss, sequence_logprob
from streamrl.learner.packing import Sample, pack_row, pack_samples, plan_packing


def test_token_logprobs_match_log_softmax_and_ignore_masked() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 1] = IGNORE_INDEX
    got = token_logprobs(logits, targets, temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    ref[0, 1] = 0.0
    torch.testing.assert_close(got, ref)
    assert got.dtype == torch.float32


def test_token_logprobs_bf16_logits_are_upcast() -> None:
    logits = torch.randn(3, 7, 13)
    targets = torch.randint(0, 13, (3, 7))
    got = token_logprobs(logits.bfloat16(), targets)
    ref = token_logprobs(logits.bfloat16().float(), targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref)


def test_entropy_uniform_and_peaked() -> None:
    logits = torch.zeros(1, 2, 8)
    logits[0, 1, 3] = 100.0
    ent = entropy(logits)
    assert ent[0, 0].item() == pytest.approx(math.log(8), rel=1e-6)
    assert ent[0, 1].item() == pytest.approx(0.0, abs=1e-6)


def test_shift_targets() -> None:
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 5, 6]])
    assert shift_targets(labels).tolist() == [[IGNORE_INDEX, 5, 6, IGNORE_INDEX]]


def test_masked_nll_is_token_mean() -> None:
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    assert masked_nll(lp, mask).item() == pytest.approx((1 + 3 + 6) / 3)
    assert sequence_logprob(lp, mask).tolist() == [-4.0, -6.0]


def test_bradley_terry_with_and_without_margin() -> None:
    rw, rl = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])
    expected = -(math.log(1 / (1 + math.exp(-1.0))) + math.log(0.5)) / 2
    assert bradley_terry_loss(rw, rl).item() == pytest.approx(expected, rel=1e-6)
    margin = torch.tensor([1.0, 0.0])
    assert bradley_terry_loss(rw, rl, margin).item() == pytest.approx(math.log(2), rel=1e-6)


def test_dpo_identical_pair_is_log2_and_ipo_cdpo_formulas() -> None:
    z = torch.zeros(3)
    out = preference_loss(z, z, z, z, beta=0.1)
    assert out.loss.item() == pytest.approx(math.log(2), rel=1e-6)
    pc, pr, rc, rr = torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.5])
    zz = (-1.0 + 3.0) - (-2.0 + 2.5)  # 1.5
    beta, eps = 0.5, 0.2

    def logsig(x: float) -> float:
        return -math.log1p(math.exp(-x))

    cdpo = preference_loss(pc, pr, rc, rr, beta, "sigmoid", eps)
    assert cdpo.loss.item() == pytest.approx(-(1 - eps) * logsig(beta * zz) - eps * logsig(-beta * zz), rel=1e-6)
    ipo = preference_loss(pc, pr, rc, rr, beta, "ipo")
    assert ipo.loss.item() == pytest.approx((zz - 1 / (2 * beta)) ** 2, rel=1e-6)
    assert cdpo.chosen_rewards.item() == pytest.approx(beta * (-1.0 + 2.0))
    assert cdpo.rejected_rewards.item() == pytest.approx(beta * (-3.0 + 2.5))
    with pytest.raises(ValueError, match="label_smoothing"):
        preference_loss(pc, pr, rc, rr, beta, "ipo", 0.1)


def test_plan_packing_best_fit_keeps_every_sample_once() -> None:
    lengths = [5, 3, 7, 2, 8, 1, 4]
    plan = plan_packing(lengths, 10)
    assert sorted(i for row in plan for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in plan)
    assert len(plan) == 3  # 30 tokens in rows of 10: best fit needs exactly 3
    with pytest.raises(ValueError, match="more than the packed row length"):
        plan_packing([11], 10)


def test_pack_row_restarts_positions_and_never_targets_across_samples() -> None:
    a = Sample([10, 11, 12], [IGNORE_INDEX, 11, 12])
    b = Sample([20, 21], [IGNORE_INDEX, 21])
    row = pack_row([a, b], 8, pad_id=0)
    assert row.input_ids == [10, 11, 12, 20, 21, 0, 0, 0]
    assert row.position_ids == [0, 1, 2, 0, 1, 0, 1, 2]
    # the last token of a sample has no target (it must not learn to predict the next sample's first token)
    assert row.targets == [11, 12, IGNORE_INDEX, 21, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    rows = pack_samples([a, b, a], 5, pad_id=0)
    assert sum(len([t for t in r.targets if t != IGNORE_INDEX]) for r in rows) == 2 + 1 + 2
