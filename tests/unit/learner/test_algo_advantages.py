"""Advantage estimators: hand-computed vectors, float64 loop references, and invariance properties."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.learner.rl.algo import advantages as adv_fns
from streamrl.learner.rl.algo.config import AlgoConfig
from streamrl.learner.rl.algo.objective import compute_advantages

F64 = torch.float64


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


# ---------------------------------------------------------------- hand-computed vectors


def test_terminal_rewards_on_last_valid_token() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    out = adv_fns.terminal_rewards(t([2.0, 3.0, 4.0]), mask)
    assert torch.equal(out, t([[0, 2, 0], [0, 0, 3], [0, 0, 0]]))


def test_discounted_returns_skips_tool_tokens() -> None:
    out = adv_fns.discounted_returns(t([[1.0, 2.0, 3.0]]), torch.ones(1, 3), gamma=0.5)
    assert torch.allclose(out, t([[2.75, 3.5, 3.0]]))
    # the middle token is a tool token: its reward is ignored, the running return carries through
    out = adv_fns.discounted_returns(t([[1.0, 99.0, 3.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5)
    assert torch.allclose(out, t([[2.5, 0.0, 3.0]]))
    out = adv_fns.discounted_returns(t([[1.0, 99.0, 3.0]]), torch.tensor([[1, 0, 1]]), gamma=1.0)
    assert torch.allclose(out, t([[4.0, 0.0, 3.0]]))


def test_gae_hand_vectors() -> None:
    rew, values, mask = t([[0.0, 1.0]]), t([[0.5, 0.2]]), torch.ones(1, 2)
    adv, ret = adv_fns.gae(rew, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, t([[0.5, 0.8]]))  # gamma = lam = 1: sum of rewards - V_t
    assert torch.allclose(ret, t([[1.0, 1.0]]))
    adv, ret = adv_fns.gae(rew, values, mask, gamma=0.9, lam=0.5)
    # delta_2 = 1 - 0.2 = 0.8; delta_1 = 0.9*0.2 - 0.5 = -0.32; A_1 = -0.32 + 0.45*0.8 = 0.04
    assert torch.allclose(adv, t([[0.04, 0.8]]))
    assert torch.allclose(ret, t([[0.54, 1.0]]))


def test_gae_padding_values_do_not_leak() -> None:
    rew, mask = t([[0.0, 1.0, 0.0]]), torch.tensor([[1, 1, 0]])
    adv, ret = adv_fns.gae(rew, t([[0.5, 0.2, 123.0]]), mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, t([[0.5, 0.8, 0.0]]))
    assert torch.allclose(ret, t([[1.0, 1.0, 0.0]]))


def test_masked_whiten_biased_token_weighted() -> None:
    x, mask = t([[1.0, 3.0], [5.0, float("nan")]]), torch.tensor([[1, 1], [1, 0]])
    out = adv_fns.masked_whiten(x, mask)
    s = math.sqrt(8 / 3)
    assert torch.allclose(out, t([[-2 / s, 0.0], [2 / s, 0.0]]))
    assert torch.allclose(adv_fns.masked_whiten(x, mask, scale=False), t([[-2.0, 0.0], [2.0, 0.0]]))
    assert torch.equal(adv_fns.masked_whiten(t([[2.0, 2.0, 2.0]]), torch.ones(1, 3)), torch.zeros(1, 3, dtype=F64))
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        adv_fns.masked_whiten(t([[1.0, 2.0]]), torch.tensor([[1, 0]]))


def test_rloo_hand() -> None:
    out = adv_fns.rloo_scores(t([1.0, 0.0, 0.0]), torch.tensor([5, 5, 5]))
    assert torch.allclose(out, t([1.0, -0.5, -0.5]))


def test_grpo_hand_unbiased_std() -> None:
    rewards, groups = t([1.0, 0.0, 0.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 0, 0, 1, 1])
    out = adv_fns.grpo_scores(rewards, groups, eps=1e-6)
    # group 0: mean 0.25, unbiased std 0.5; group 1: all equal -> 0
    expected = t([0.75, -0.25, -0.25, -0.25, 0.0, 0.0]) / t([0.5 + 1e-6] * 4 + [1.0] * 2)
    assert torch.allclose(out, expected)


def test_dr_grpo_and_flash_hand() -> None:
    out = adv_fns.dr_grpo_scores(t([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0]))
    assert torch.allclose(out, t([0.75, -0.25, -0.25, -0.25]))
    assert torch.allclose(adv_fns.flash_reinforce_scores(t([1.0, 2.0, 3.0])), t([-1.0, 0.0, 1.0]))


def test_group_of_one_rejected() -> None:
    rewards, groups = t([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1])
    for fn in (adv_fns.rloo_scores, adv_fns.grpo_scores, adv_fns.dr_grpo_scores):
        with pytest.raises(ValueError, match="at least 2 samples"):
            fn(rewards, groups)
    with pytest.raises(ValueError, match="integer group ids"):
        adv_fns.grpo_scores(rewards, t([0.0, 0.0, 1.0]))


def test_reinforce_baseline_recentres_all_equal_group() -> None:
    # group 0 all equal (a = 0), group 1 has a long negative sample: the token-weighted global mean
    # is negative, so group 0 ends with a positive advantage (algorithms.md 1.4 subtlety).
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    out = adv_fns.reinforce_baseline(t([1.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]), mask, None)
    tokens = [0.0, 0.0, 0.0, 0.0, 0.5, -0.5, -0.5, -0.5]
    mu, sigma = statistics.fmean(tokens), statistics.pstdev(tokens)
    assert mu == -0.125
    assert torch.allclose(out[0, 0], t((0.0 - mu) / sigma))
    assert float(out[0, 0]) > 0
    assert torch.allclose(out[3], t([(-0.5 - mu) / sigma] * 3))


# ---------------------------------------------------------------- float64 loop references


def random_batch(seed: int, B: int = 6, T: int = 7, groups: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1  # every sequence has at least one token
    return {
        "rewards": torch.randn(B, generator=g, dtype=F64),
        "group_index": torch.arange(B) % groups,
        "mask": mask,
        "kl": torch.randn(B, T, generator=g, dtype=F64) * 0.1,
        "values": torch.randn(B, T, generator=g, dtype=F64),
    }


def ref_valid_positions(mask_row: torch.Tensor) -> list[int]:
    return [j for j, m in enumerate(mask_row.tolist()) if m]


def ref_return_to_go(scalar: float, kl: list[float], gamma: float) -> list[float]:
    """Return-to-go over the valid tokens only (tool tokens removed), reward on the last one."""
    rew = [-k for k in kl]
    rew[-1] += scalar
    out, running = [0.0] * len(rew), 0.0
    for j in reversed(range(len(rew))):
        running = rew[j] + gamma * running
        out[j] = running
    return out


def ref_whiten(rows: list[list[float]]) -> list[list[float]]:
    flat = [x for row in rows for x in row]
    mu, var = statistics.fmean(flat), statistics.pvariance(flat)
    return [[(x - mu) / math.sqrt(max(var, 1e-8)) for x in row] for row in rows]


def scatter(rows: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(mask.shape, dtype=F64)
    for i, row in enumerate(rows):
        for j, x in zip(ref_valid_positions(mask[i]), row, strict=True):
            out[i, j] = x
    return out


def ref_group_mean(rewards: list[float], groups: list[int], i: int, leave_out: bool = False) -> float:
    others = [
        r for j, (r, g) in enumerate(zip(rewards, groups, strict=True)) if g == groups[i] and not (leave_out and j == i)
    ]
    return statistics.fmean(others)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_loop_reference(seed: int) -> None:
    b = random_batch(seed)
    gamma, lam = 0.9, 0.8
    rows_adv, rows_ret = [], []
    for i in range(b["mask"].shape[0]):
        pos = ref_valid_positions(b["mask"][i])
        rew = [-float(b["kl"][i, j]) for j in pos]
        rew[-1] += float(b["rewards"][i])
        v = [float(b["values"][i, j]) for j in pos] + [0.0]
        adv, running = [0.0] * len(pos), 0.0
        for j in reversed(range(len(pos))):
            running = rew[j] + gamma * v[j + 1] - v[j] + gamma * lam * running
            adv[j] = running
        rows_adv.append(adv)
        rows_ret.append([a + v[j] for j, a in enumerate(adv)])
    token_rewards = adv_fns.terminal_rewards(b["rewards"], b["mask"]) - torch.where(b["mask"].bool(), b["kl"], 0.0)
    adv, ret = adv_fns.gae(token_rewards, b["values"], b["mask"], gamma, lam)
    assert torch.allclose(adv, scatter(rows_adv, b["mask"]))
    assert torch.allclose(ret, scatter(rows_ret, b["mask"]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_family_matches_loop_reference(seed: int) -> None:
    b = random_batch(seed)
    rewards, groups = b["rewards"].tolist(), b["group_index"].tolist()
    kl_rows = [[float(b["kl"][i, j]) for j in ref_valid_positions(b["mask"][i])] for i in range(len(rewards))]

    rows = [ref_return_to_go(rewards[i], kl_rows[i], 0.95) for i in range(len(rewards))]
    out = adv_fns.reinforce_plus_plus(b["rewards"], b["mask"], b["kl"], gamma=0.95)
    assert torch.allclose(out, scatter(ref_whiten(rows), b["mask"]))

    rows = [
        ref_return_to_go(rewards[i] - ref_group_mean(rewards, groups, i), kl_rows[i], 1.0) for i in range(len(rewards))
    ]
    out = adv_fns.reinforce_baseline(b["rewards"], b["group_index"], b["mask"], b["kl"])
    assert torch.allclose(out, scatter(ref_whiten(rows), b["mask"]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_scores_match_loop_reference(seed: int) -> None:
    b = random_batch(seed, B=9, groups=3)
    rewards, groups = b["rewards"].tolist(), b["group_index"].tolist()
    rloo, grpo, dr = [], [], []
    for i, r in enumerate(rewards):
        members = [x for x, g in zip(rewards, groups, strict=True) if g == groups[i]]
        rloo.append(r - ref_group_mean(rewards, groups, i, leave_out=True))
        grpo.append((r - statistics.fmean(members)) / (statistics.stdev(members) + 1e-6))
        dr.append(r - statistics.fmean(members))
    assert torch.allclose(adv_fns.rloo_scores(b["rewards"], b["group_index"]), t(rloo))
    assert torch.allclose(adv_fns.grpo_scores(b["rewards"], b["group_index"]), t(grpo))
    assert torch.allclose(adv_fns.dr_grpo_scores(b["rewards"], b["group_index"]), t(dr))


# ---------------------------------------------------------------- properties (through compute_advantages)

ESTIMATORS = ["gae", "reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "flash_reinforce"]


def config(estimator: str) -> AlgoConfig:
    data: dict[str, object] = {"advantage": {"estimator": estimator}, "kl": {"placement": "reward", "coef": 0.1}}
    if estimator == "gae":
        data["critic"] = {}
        data["advantage"] = {"estimator": "gae", "gamma": 0.9, "lam": 0.8}
    return AlgoConfig.model_validate(data)


def run(estimator: str, b: dict[str, torch.Tensor]) -> torch.Tensor:
    adv, _ = compute_advantages(
        config(estimator),
        rewards=b["rewards"],
        group_index=b["group_index"],
        mask=b["mask"],
        kl=b["kl"],
        values=b["values"],
    )
    return adv


@settings(max_examples=15, deadline=None)
@given(estimator=st.sampled_from(ESTIMATORS), seed=st.integers(0, 10_000), extra=st.integers(1, 4))
def test_padding_invariance(estimator: str, seed: int, extra: int) -> None:
    """Extra padded columns holding garbage change nothing on the original columns."""
    b = random_batch(seed)
    B = b["mask"].shape[0]
    padded = dict(b)
    padded["mask"] = torch.cat([b["mask"], torch.zeros(B, extra, dtype=torch.long)], dim=1)
    for key in ("kl", "values"):
        padded[key] = torch.cat([b[key], torch.full((B, extra), 1e6, dtype=F64)], dim=1)
    out, out_padded = run(estimator, b), run(estimator, padded)
    assert torch.allclose(out_padded[:, : b["mask"].shape[1]], out)
    assert torch.equal(out_padded[:, b["mask"].shape[1] :], torch.zeros(B, extra, dtype=F64))


@settings(max_examples=15, deadline=None)
@given(estimator=st.sampled_from(ESTIMATORS), seed=st.integers(0, 10_000))
def test_tool_token_invariance(estimator: str, seed: int) -> None:
    """Interior mask-0 (tool) tokens behave as if removed: compare with the left-compacted batch."""
    b = random_batch(seed)
    compact = {k: v for k, v in b.items()}
    compact["mask"] = torch.zeros_like(b["mask"])
    for key in ("kl", "values"):
        compact[key] = torch.zeros_like(b[key])
    for i in range(b["mask"].shape[0]):
        pos = ref_valid_positions(b["mask"][i])
        compact["mask"][i, : len(pos)] = 1
        for key in ("kl", "values"):
            compact[key][i, : len(pos)] = b[key][i, pos]
    out, out_compact = run(estimator, b), run(estimator, compact)
    for i in range(b["mask"].shape[0]):
        pos = ref_valid_positions(b["mask"][i])
        assert torch.allclose(out[i, pos], out_compact[i, : len(pos)])


@settings(max_examples=15, deadline=None)
@given(estimator=st.sampled_from(ESTIMATORS), seed=st.integers(0, 10_000), perm_seed=st.integers(0, 10_000))
def test_permutation_equivariance(estimator: str, seed: int, perm_seed: int) -> None:
    """Reordering samples (within and across groups) reorders the advantages the same way."""
    b = random_batch(seed)
    perm = torch.randperm(b["mask"].shape[0], generator=torch.Generator().manual_seed(perm_seed))
    permuted = {k: v[perm] for k, v in b.items()}
    assert torch.allclose(run(estimator, permuted), run(estimator, b)[perm])
