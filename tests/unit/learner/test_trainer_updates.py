"""Several optimizer updates per training batch (learner.mini_batches / ppo_epochs).

The plan of updates is pure and checked on its own; the trainer is checked against a plain-torch
replay of the same updates: log pi_old recorded once before the first update, advantages over the
whole batch, each update normalised over its own rows and clipped against pi_old.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.common.messages import SamplingParams, ScoredTrajectory, Tensor, TrainingBatch, Trajectory
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.lm_forward import rl_response_logprobs
from streamrl.learner.rl.algo.losses import normaliser_count
from streamrl.learner.rl.algo.objective import compute_advantages, policy_objective
from streamrl.learner.rl.batch import collate, micro_batches, update_plan
from streamrl.learner.rl.config import LearnerConfig
from streamrl.learner.rl.trainer import RLTrainer
from streamrl.learner.varlen_attention import register as varlen_attention


def groups_of(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([g for g, n in enumerate(sizes) for _ in range(n)])


@pytest.mark.parametrize("mini_batches,epochs,grad_accum", [(2, 1, 1), (3, 2, 2), (4, 1, 3)])
def test_every_pass_covers_each_row_once_in_whole_groups(mini_batches: int, epochs: int, grad_accum: int) -> None:
    group_index = groups_of([2, 3, 1, 2, 2, 4])
    plan = update_plan(group_index, mini_batches=mini_batches, epochs=epochs, grad_accum=grad_accum, seed=7)
    assert len(plan) == mini_batches * epochs
    assert all(len(update) == grad_accum for update in plan)
    for e in range(epochs):
        rows = [r for update in plan[e * mini_batches : (e + 1) * mini_batches] for chunk in update for r in chunk]
        assert sorted(rows) == list(range(len(group_index)))
    for update in plan:
        rows = [r for chunk in update for r in chunk]
        groups = set(group_index[rows].tolist())
        assert sorted(rows) == [r for r in range(len(group_index)) if int(group_index[r]) in groups]
    assert plan == update_plan(group_index, mini_batches=mini_batches, epochs=epochs, grad_accum=grad_accum, seed=7)


def test_one_mini_batch_keeps_the_rows_in_order() -> None:
    group_index = groups_of([2, 2, 2])
    assert update_plan(group_index, mini_batches=1, epochs=2, grad_accum=2, seed=0) == [micro_batches(6, 2)] * 2


def test_fewer_groups_than_mini_batches_leaves_empty_updates() -> None:
    plan = update_plan(groups_of([2, 2]), mini_batches=3, epochs=1, grad_accum=1, seed=0)
    assert sorted(len(update[0]) for update in plan) == [0, 2, 2]


def scored_batch(num_groups: int = 4, group_size: int = 2, seed: int = 0) -> TrainingBatch:
    """Groups of one random prompt each; responses of 1-4 tokens, behaviour log-probs and rewards at random."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(num_groups):
        prompt = rng.integers(3, 259, size=int(rng.integers(3, 6))).astype(np.int32)
        for j in range(group_size):
            n = int(rng.integers(1, 5))
            traj = Trajectory(
                id=f"p{g}/{j}",
                group_id=f"p{g}",
                group_index=j,
                group_size=group_size,
                prompt_ids=Tensor.from_numpy(prompt),
                response_ids=Tensor.from_numpy(rng.integers(3, 259, size=n).astype(np.int32)),
                logprobs=Tensor.from_numpy(rng.uniform(-6.0, -4.0, size=n).astype(np.float32)),
                loss_mask=Tensor.from_numpy(np.ones(n, dtype=np.uint8)),
                sampling=SamplingParams(temperature=1.0),
            )
            samples.append(ScoredTrajectory(trajectory=traj, reward=float(rng.integers(0, 2)) + 0.1 * j))
    return TrainingBatch(id="batch-3", index=3, samples=samples, policy_version=0, staleness=[0] * len(samples))


def test_trainer_takes_each_planned_update_against_pi_old(tiny_qwen_dir: Path) -> None:
    lr, mini_batches = 1e-2, 2  # a large step, so that the second update's ratio is far from 1
    ds = DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant", lr=lr, grad_clip=0.0)
    cfg = LearnerConfig(model=str(tiny_qwen_dir), ds=ds, mini_batches=mini_batches, total_steps=4)
    batch = scored_batch()
    trainer = RLTrainer(cfg)
    metrics = trainer.step(batch)
    assert metrics["learner/updates"] == mini_batches
    assert trainer.policy.global_steps == mini_batches

    # the same updates replayed with plain torch from the same initial weights
    model = AutoModelForCausalLM.from_pretrained(
        tiny_qwen_dir, dtype=torch.float32, attn_implementation=varlen_attention()
    )
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=ds.betas, eps=ds.eps, weight_decay=0.0)
    rl = collate(batch, pad_id=0)
    with torch.no_grad():
        old = rl_response_logprobs(model, rl, ds, with_entropy=False)[0]  # the trainer's forward (lm_forward)
    advantages, _ = compute_advantages(cfg.algo, rewards=rl.rewards, group_index=rl.group_index, mask=rl.mask)
    plan = update_plan(rl.group_index, mini_batches=mini_batches, epochs=1, grad_accum=1, seed=zlib.crc32(b"batch-3"))
    ratios = []
    for (rows,) in plan:
        mb = rl.select(rows)
        logp = rl_response_logprobs(model, mb, ds, with_entropy=False)[0]
        loss, m = policy_objective(
            cfg.algo,
            logprobs=logp,
            old_logprobs=old[rows],
            advantages=advantages[rows],
            mask=mb.mask,
            normaliser=float(normaliser_count(mb.mask, cfg.algo.loss.aggregation)),
            behaviour_logprobs=mb.behaviour_logprobs,
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ratios.append(m["learner/ratio_mean"])
    assert ratios[0] == pytest.approx(1.0) and abs(ratios[1] - 1.0) > 1e-3  # the second update is off-policy
    trained = dict(trainer.policy.module.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(trained[name].detach(), p.detach(), rtol=1e-4, atol=1e-6, msg=name)
