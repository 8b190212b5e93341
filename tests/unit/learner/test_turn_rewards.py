"""Per-turn rewards of multi-turn episodes through collate and every advantage estimator.

The rule under test (docs/multiturn.md): the token-level estimators (gae, reinforce) credit each
turn's reward on that turn's last model token and the rest of the scalar return on the last model
token; the outcome estimators use the scalar return alone. Environment tokens (mask 0) are skipped:
a multi-turn row gets exactly the advantages of its model tokens laid end to end, discounting
included, and nothing placed at an environment position (value, KL, reward) changes anything.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.common.codec import decode, encode
from streamrl.common.messages import ScoredTrajectory, Tensor, TrainingBatch, Trajectory, Turn
from streamrl.learner.rl.algo import advantages as adv
from streamrl.learner.rl.algo.config import AlgoConfig
from streamrl.learner.rl.algo.objective import compute_advantages, shape_rewards
from streamrl.learner.rl.batch import collate


def episode(
    group: str, index: int, pieces: list[tuple[str, int]], turn_rewards: list[float], seed: int = 0
) -> ScoredTrajectory:
    """A scored multi-turn trajectory from ``pieces`` of ``("model", n)`` / ``("env", n)`` tokens; one
    reward per model piece (the final reward already in the last), ``reward`` their sum."""
    rng = np.random.default_rng(seed)
    ids, logprobs, mask, turns = [], [], [], []
    for kind, n in pieces:
        start = len(ids)
        ids += rng.integers(3, 259, size=n).tolist()
        logprobs += rng.uniform(-3.0, -0.1, size=n).tolist() if kind == "model" else [0.0] * n
        mask += [1 if kind == "model" else 0] * n
        if kind == "model":
            turns.append(Turn(start=start, end=start + n, policy_version=0, reward=0.0))
    traj = Trajectory(
        id=f"{group}/{index}",
        group_id=group,
        group_index=index,
        group_size=2,
        prompt_ids=Tensor.from_list([5, 6, 7], "int32"),
        response_ids=Tensor.from_list(ids, "int32"),
        logprobs=Tensor.from_list(logprobs, "float32"),
        loss_mask=Tensor.from_list(mask, "uint8"),
        turns=turns,
        stop_reason="done",
    )
    return ScoredTrajectory(trajectory=traj, reward=float(sum(turn_rewards)), turn_rewards=turn_rewards)


def single(group: str, index: int, n: int, reward: float) -> ScoredTrajectory:
    s = episode(group, index, [("model", n)], [reward])
    traj = Trajectory(**{f: getattr(s.trajectory, f) for f in s.trajectory.__struct_fields__ if f != "turns"})
    return ScoredTrajectory(trajectory=traj, reward=reward)  # no turns, no turn_rewards: today's single turn


def test_collate_puts_each_earlier_turn_reward_on_its_last_model_token() -> None:
    batch = TrainingBatch(
        id="batch-0",
        index=0,
        policy_version=0,
        staleness=[0, 0, 0],
        samples=[
            episode("a", 0, [("model", 2), ("env", 3), ("model", 1), ("env", 2), ("model", 3)], [1.0, -0.5, 2.0]),
            episode("a", 1, [("model", 4), ("env", 1), ("model", 2)], [0.25, 3.0]),
            single("b", 0, 5, 1.5),
        ],
    )
    rl = collate(decode(encode(batch), TrainingBatch), pad_id=0)  # through the wire format first
    assert rl.mask[0].tolist() == [1, 1, 0, 0, 0, 1, 0, 0, 1, 1, 1]
    expected = torch.zeros(3, 11)
    expected[0, 1], expected[0, 5], expected[1, 3] = 1.0, -0.5, 0.25  # last turns stay in the remainder
    assert torch.equal(rl.turn_rewards, expected)
    assert rl.rewards.tolist() == [2.5, 3.25, 1.5]
    assert torch.equal(rl.behaviour_logprobs[rl.mask == 0][: 3 + 2 + 1], torch.zeros(6))


def test_a_turn_without_model_tokens_leaves_its_reward_to_the_end() -> None:
    sample = episode("a", 0, [("model", 2), ("env", 2), ("model", 3)], [0.5, 1.0])
    masked = np.array([1, 1, 0, 0, 0, 0, 0], dtype=np.uint8)  # the second turn's tokens all masked
    t = sample.trajectory
    turns = [Turn(start=0, end=0, policy_version=0, reward=0.0), Turn(start=4, end=7, policy_version=0)]
    empty_first = ScoredTrajectory(
        trajectory=Trajectory(**{**_fields(t), "turns": turns}), reward=1.5, turn_rewards=[0.5, 1.0]
    )
    only_first = ScoredTrajectory(
        trajectory=Trajectory(**{**_fields(t), "loss_mask": Tensor.from_numpy(masked)}),
        reward=1.5,
        turn_rewards=[0.5, 1.0],
    )
    rl = collate(
        TrainingBatch(id="b", index=0, samples=[empty_first, only_first], policy_version=0, staleness=[0, 0]), pad_id=0
    )
    assert rl.turn_rewards[0].tolist() == [0.0] * 7  # nothing before turn 0's end: all at the last token
    assert rl.turn_rewards[1].tolist() == [0.0, 0.5] + [0.0] * 5
    token = adv.token_rewards(rl.rewards, rl.mask, rl.turn_rewards)
    assert token[0].tolist() == [0.0] * 6 + [1.5]
    assert token[1].tolist() == [0.0, 1.5] + [0.0] * 5  # the last model token is turn 0's


def _fields(t: Trajectory) -> dict[str, object]:
    return {f: getattr(t, f) for f in t.__struct_fields__}


@pytest.mark.parametrize(
    "turns,rewards,match",
    [
        ([(0, 2), (5, 6)], [1.0], "1 turn_rewards for 2 turns"),
        ([(0, 3), (2, 6)], [1.0, 0.0], "must follow the previous turn"),
        ([(0, 2), (5, 12)], [1.0, 0.0], "inside the response of 9 tokens"),
    ],
)
def test_inconsistent_turns_are_refused(turns: list[tuple[int, int]], rewards: list[float], match: str) -> None:
    t = episode("a", 0, [("model", 2), ("env", 3), ("model", 4)], [0.0, 0.0]).trajectory
    bad = Trajectory(**{**_fields(t), "turns": [Turn(start=s, end=e, policy_version=0) for s, e in turns]})
    batch = TrainingBatch(
        id="b",
        index=0,
        samples=[ScoredTrajectory(trajectory=bad, reward=1.0, turn_rewards=rewards)],
        policy_version=0,
        staleness=[0],
    )
    with pytest.raises(ValueError, match=match):
        collate(batch, pad_id=0)


def test_returns_by_hand_discount_per_model_token() -> None:
    # m m e e m m e m; turn rewards 1 (pos 1), 0.5 (pos 5); final 2 (pos 7); gamma 0.5 per model token
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1]], dtype=torch.float32)
    turn = torch.zeros(1, 8)
    turn[0, 1], turn[0, 5] = 1.0, 0.5
    returns = adv.shaped_returns(torch.tensor([3.5]), mask, None, gamma=0.5, turn_rewards=turn)
    g7 = 2.0
    g5 = 0.5 + 0.5 * g7
    g4 = 0.5 * g5
    g1 = 1.0 + 0.5 * g4
    g0 = 0.5 * g1
    assert returns[0].tolist() == pytest.approx([g0, g1, 0, 0, g4, g5, 0, g7])


def test_token_rewards_sum_to_the_shaped_return() -> None:
    """Shaping acts on the scalar return; the final turn absorbs the difference (here a clip to 2)."""
    cfg = AlgoConfig(shaping={"reward_clip": (-2.0, 2.0)})
    rl = collate(
        TrainingBatch(
            id="b",
            index=0,
            policy_version=0,
            staleness=[0],
            samples=[episode("a", 0, [("model", 2), ("env", 1), ("model", 2)], [1.5, 1.0])],
        ),
        pad_id=0,
    )
    shaped = shape_rewards(cfg, rewards=rl.rewards)
    token = adv.token_rewards(shaped, rl.mask, rl.turn_rewards)
    assert token[0].tolist() == [0.0, 1.5, 0.0, 0.0, 0.5] and float(token.sum()) == 2.0


ESTIMATORS = ["gae", "reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "flash_reinforce"]


def _cfg(estimator: str, kl_in_reward: bool) -> AlgoConfig:
    extra: dict[str, object] = {}
    advantage: dict[str, object] = {"estimator": estimator}
    if estimator == "gae":
        advantage |= {"gamma": 0.9, "lam": 0.8}
        extra["critic"] = {}
    if estimator == "reinforce":
        advantage["gamma"] = 0.9
    kl = {"placement": "reward", "coef": 0.1} if kl_in_reward else {"placement": "none"}
    return AlgoConfig(advantage=advantage, kl=kl, **extra)


def _multiturn_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """rewards [4], group_index [4], mask [4,T] (environment gaps, padding), turn_rewards [4,T]."""
    samples = [
        episode("a", 0, [("model", 2), ("env", 3), ("model", 1), ("env", 2), ("model", 3)], [1.0, -0.5, 2.0], seed=1),
        episode("a", 1, [("model", 4), ("env", 1), ("model", 2)], [0.25, 0.0], seed=2),
        episode("b", 0, [("model", 1), ("env", 4), ("model", 2), ("env", 1)], [0.0, 1.0], seed=3),
        episode("b", 1, [("model", 3)], [0.5], seed=4),
    ]
    rl = collate(TrainingBatch(id="b", index=0, samples=samples, policy_version=0, staleness=[0] * 4), pad_id=0)
    return rl.rewards, rl.group_index, rl.mask, rl.turn_rewards


def _compress(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's model-token entries laid end to end (the environment's removed), zero-padded."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        kept = x[i][mask[i].bool()]
        out[i, : kept.numel()] = kept
    return out


@pytest.mark.parametrize("kl_in_reward", [False, True])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_environment_tokens_change_nothing(estimator: str, kl_in_reward: bool) -> None:
    """Against the same episodes without their environment tokens: the same advantages on model tokens
    (so discounting and whitening count model tokens only), 0 on environment tokens; and values, KL or
    rewards placed at environment positions are ignored."""
    rewards, groups, mask, turn = _multiturn_batch()
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(mask.shape, generator=gen)
    kl = torch.rand(mask.shape, generator=gen) * mask
    cfg = _cfg(estimator, kl_in_reward)
    args = {"rewards": rewards, "group_index": groups, "kl": kl if kl_in_reward else None}
    a, ret = compute_advantages(cfg, mask=mask, values=values, turn_rewards=turn, **args)  # type: ignore[arg-type]

    packed_mask = _compress(mask, mask)
    a_ref, ret_ref = compute_advantages(
        cfg,
        mask=packed_mask,
        values=_compress(values, mask),
        turn_rewards=_compress(turn, mask),
        **{**args, "kl": _compress(kl, mask) if kl_in_reward else None},  # type: ignore[arg-type]
    )
    torch.testing.assert_close(_compress(a, mask), a_ref, rtol=1e-6, atol=1e-6)
    assert bool((a[mask == 0] == 0).all())
    if ret is not None:
        assert ret_ref is not None
        torch.testing.assert_close(_compress(ret, mask), ret_ref, rtol=1e-6, atol=1e-6)

    env = mask == 0
    noisy_values = torch.where(env, values + 100.0, values)
    noisy_kl = torch.where(env, kl - 50.0, kl)
    noisy_turn = torch.where(env, turn + 7.0, turn)
    a2, ret2 = compute_advantages(
        cfg,
        mask=mask,
        values=noisy_values,
        turn_rewards=noisy_turn,
        **{**args, "kl": noisy_kl if kl_in_reward else None},  # type: ignore[arg-type]
    )
    assert torch.equal(a2, a)
    assert (ret2 is None and ret is None) or torch.equal(ret2, ret)  # type: ignore[arg-type]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_single_turn_numbers_are_unchanged(estimator: str) -> None:
    """No turn rewards (or all zero: single-turn rows of a mixed batch) give today's numbers, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    mask = (torch.arange(6)[None, :] < torch.tensor([[6], [3], [5], [2]])).float()
    rewards = torch.randn(4, generator=gen)
    values, kl = torch.randn(4, 6, generator=gen), torch.rand(4, 6, generator=gen) * mask
    cfg = _cfg(estimator, kl_in_reward=True)
    args = {"rewards": rewards, "group_index": torch.tensor([0, 0, 1, 1]), "mask": mask, "kl": kl, "values": values}
    before = compute_advantages(cfg, **args)  # type: ignore[arg-type]
    after = compute_advantages(cfg, turn_rewards=torch.zeros(4, 6), **args)  # type: ignore[arg-type]
    assert torch.equal(before[0], after[0])
    assert (before[1] is None and after[1] is None) or torch.equal(before[1], after[1])  # type: ignore[arg-type]


@pytest.mark.parametrize("estimator", ["reinforce_baseline", "rloo", "grpo", "dr_grpo", "flash_reinforce"])
def test_outcome_estimators_use_the_scalar_return(estimator: str) -> None:
    rewards, groups, mask, turn = _multiturn_batch()
    cfg = _cfg(estimator, kl_in_reward=False)
    with_turns, _ = compute_advantages(cfg, rewards=rewards, group_index=groups, mask=mask, turn_rewards=turn)
    without, _ = compute_advantages(cfg, rewards=rewards, group_index=groups, mask=mask)
    assert torch.equal(with_turns, without)


def test_token_level_estimators_credit_each_turn_where_it_ended() -> None:
    """reinforce with gamma 1, no whitening: the advantage of a token is the reward still to come."""
    rewards, groups, mask, turn = _multiturn_batch()
    cfg = AlgoConfig(advantage={"estimator": "reinforce", "std_normalize": False})
    a, _ = compute_advantages(cfg, rewards=rewards, group_index=groups, mask=mask, turn_rewards=turn)
    to_come = [
        [2.5, 2.5, 0, 0, 0, 1.5, 0, 0, 2.0, 2.0, 2.0],
        [0.25, 0.25, 0.25, 0.25, 0, 0.0, 0.0, 0, 0, 0, 0],
        [1.0, 0, 0, 0, 0, 1.0, 1.0, 0, 0, 0, 0],
        [0.5, 0.5, 0.5, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
    expected = torch.tensor(to_come) * mask
    centred = expected - (expected.sum() / mask.sum()) * mask  # reinforce still centres over the batch
    torch.testing.assert_close(a, centred)
