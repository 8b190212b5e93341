"""The learner's gradient on multi-turn episodes equals a plain-torch reference over model tokens only.

A tiny Qwen2 policy (and a differently initialised reference model for the KL) trains on three
episodes of three turns each, environment tokens between the turns. The trainer's gradient (read
before its optimizer step) is compared with one computed here from scratch: an eager-attention
forward per episode, log-probs, entropies and KL at the model's tokens only (found from ``turns``,
not from the loss mask), per-turn rewards and advantages by hand, the loss written out. Then the
environment tokens' behaviour log-probs are replaced by garbage: the gradient stays bit for bit the
same; and unmasking the environment tokens changes it (so the comparison can fail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.common.messages import SamplingParams, ScoredTrajectory, Tensor, TrainingBatch, Trajectory, Turn
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.rl.config import LearnerConfig
from streamrl.learner.rl.trainer import RLTrainer

# (model tokens, environment tokens after them) per turn, and the environment's reward after each turn
EPISODES = [
    ([(3, 4), (2, 3), (4, 0)], [0.5, -0.25, 0.0]),
    ([(2, 2), (1, 5), (3, 2)], [0.0, 1.0, 0.0]),
    ([(4, 3), (3, 1), (2, 0)], [0.25, 0.0, 0.5]),
]
FINAL = [1.0, 0.0, 1.0]
"""The scorer's final reward of each episode (added to its last turn, as the reward tier does)."""
TEMPERATURES = [1.0, 0.7, 1.0]


def episodes(seed: int = 0, env_logprob: float | None = None, unmask_env: bool = False) -> TrainingBatch:
    """One group of three scored episodes. ``env_logprob`` replaces the environment tokens' behaviour
    log-probs (0 by contract) with random values around it; ``unmask_env`` sets their loss mask to 1."""
    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(100 + seed)
    prompt = rng.integers(3, 259, size=5).astype(np.int32)
    samples = []
    for j, ((spans, env_rewards), final) in enumerate(zip(EPISODES, FINAL, strict=True)):
        ids, logprobs, mask, turns = [], [], [], []
        for (n_model, n_env), reward in zip(spans, env_rewards, strict=True):
            turns.append(Turn(start=len(ids), end=len(ids) + n_model, policy_version=0, reward=reward))
            ids += rng.integers(3, 259, size=n_model + n_env).tolist()
            logprobs += rng.uniform(-6.0, -5.0, size=n_model).tolist()
            env = [0.0] * n_env if env_logprob is None else (env_logprob + 3 * noise.standard_normal(n_env)).tolist()
            logprobs += env
            mask += [1] * n_model + [1 if unmask_env else 0] * n_env
        turn_rewards = [t.reward for t in turns]
        turn_rewards[-1] += final
        traj = Trajectory(
            id=f"g/{j}",
            group_id="g",
            group_index=j,
            group_size=3,
            prompt_ids=Tensor.from_numpy(prompt),
            response_ids=Tensor.from_list(ids, "int32"),
            logprobs=Tensor.from_list(logprobs, "float32"),
            loss_mask=Tensor.from_list(mask, "uint8"),
            sampling=SamplingParams(temperature=TEMPERATURES[j]),
            turns=turns,
            stop_reason="done",
        )
        samples.append(ScoredTrajectory(trajectory=traj, reward=sum(turn_rewards), turn_rewards=turn_rewards))
    return TrainingBatch(id="batch-0", index=0, samples=samples, policy_version=0, staleness=[0, 0, 0])


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory: pytest.TempPathFactory, tiny_qwen_dir: Path) -> Path:
    """A second tiny model of the same shape (other random weights): the KL reference."""
    out = tmp_path_factory.mktemp("tiny_qwen2_ref")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(out)
    for f in tiny_qwen_dir.iterdir():  # the tokenizer's files
        if not (out / f.name).exists():
            (out / f.name).write_bytes(f.read_bytes())
    return out


CONFIGS: dict[str, dict[str, Any]] = {
    # token-level estimator: per-turn rewards at their turns' ends, discounted per model token
    "reinforce": {
        "advantage": {"estimator": "reinforce", "gamma": 0.9},
        "kl": {"placement": "loss", "estimator": "k3", "coef": 0.1},
        "loss": {"aggregation": "seq-mean-token-mean", "entropy_coef": 0.01},
        "correction": {"type": "tis", "low": 0.8, "high": 1.2},
    },
    # outcome estimator: the scalar return; KL in the reward
    "grpo": {
        "advantage": {"estimator": "grpo"},
        "kl": {"placement": "reward", "estimator": "k1", "coef": 0.1},
        "loss": {"aggregation": "token-mean"},
        "correction": {"type": "icepop", "low": 0.8, "high": 1.25},
    },
}


def learner_gradient(trainer: RLTrainer, batch: TrainingBatch) -> dict[str, torch.Tensor]:
    """The gradient the trainer's step on ``batch`` hands its optimizer (the step itself is skipped,
    so the weights stay as they are for the next call)."""
    grads: dict[str, torch.Tensor] = {}
    module = trainer.policy.module

    def capture() -> bool:
        for name, p in module.named_parameters():
            grads[name] = p.grad.detach().clone()
        module.zero_grad(set_to_none=True)
        return True

    trainer.policy.step = capture  # type: ignore[method-assign]
    trainer.step(batch)
    return grads


def model_positions(traj: Trajectory) -> torch.Tensor:
    return torch.tensor([t for turn in traj.turns for t in range(turn.start, turn.end)])


def forward(model: Any, traj: Trajectory) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [n] of the model tokens of ``traj`` (logits over the sampling temperature)."""
    prompt, response = traj.prompt_ids.tolist(), traj.response_ids.tolist()
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
    pos = model_positions(traj)
    step_logits = logits[len(prompt) - 1 + pos] / traj.sampling.temperature
    logp_all = torch.log_softmax(step_logits.float(), dim=-1)
    targets = torch.tensor(response)[pos]
    return logp_all.gather(1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def reference_gradient(name: str, policy_dir: Path, ref_dir: Path, batch: TrainingBatch) -> dict[str, torch.Tensor]:
    """The loss of ``CONFIGS[name]`` written out by hand over model tokens only; its gradient."""
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32, attn_implementation="eager")
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation="eager")
    trajs = [s.trajectory for s in batch.samples]
    logp, entropy = zip(*(forward(policy, t) for t in trajs), strict=True)
    with torch.no_grad():
        ref_logp = [forward(ref, t)[0] for t in trajs]
    behaviour = [torch.tensor(t.logprobs.tolist())[model_positions(t)] for t in trajs]
    old = [lp.detach() for lp in logp]  # one update per batch: pi_old is the policy before the step
    returns = torch.tensor([s.reward for s in batch.samples])

    if name == "reinforce":
        advantages = []
        for s in batch.samples:  # reward of turn k on its last model token; return-to-go per model token
            rewards = [0.0] * sum(turn.end - turn.start for turn in s.trajectory.turns)
            ends = np.cumsum([turn.end - turn.start for turn in s.trajectory.turns]) - 1
            for end, r in zip(ends, s.turn_rewards, strict=True):
                rewards[end] += r
            g, out = 0.0, []
            for r in reversed(rewards):
                g = r + 0.9 * g
                out.append(g)
            advantages.append(torch.tensor(out[::-1]))
        flat = torch.cat(advantages)
        mean, var = flat.mean(), ((flat - flat.mean()) ** 2).mean()
        advantages = [(a - mean) / var.clamp(min=1e-8).sqrt() for a in advantages]
        weights = [torch.exp(o - b).clamp(0.8, 1.2) for o, b in zip(old, behaviour, strict=True)]
    else:
        score = (returns - returns.mean()) / (returns.std() + 1e-6)  # one group of three
        advantages = []
        for i, (o, r) in enumerate(zip(old, ref_logp, strict=True)):
            kl = (o - r).clamp(-10, 10)
            kl_to_come = kl.flip(0).cumsum(0).flip(0)
            advantages.append(score[i] - 0.1 * kl_to_come)
        rho = [torch.exp(o - b) for o, b in zip(old, behaviour, strict=True)]
        weights = [torch.where((x >= 0.8) & (x <= 1.25), x, 0.0) for x in rho]

    per_token = []
    for lp, o, a, w in zip(logp, old, advantages, weights, strict=True):
        ratio = torch.exp(lp - o)  # 1, with the gradient of log pi
        per_token.append(-w * a * ratio)
    if name == "reinforce":  # seq-mean-token-mean, k3 KL in the loss, entropy bonus
        k3 = [torch.exp(r - lp) - 1 - (r - lp) for lp, r in zip(logp, ref_logp, strict=True)]

        def agg(xs: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([x.mean() for x in xs]).mean()

        loss = agg(per_token) + 0.1 * agg(k3) - 0.01 * agg(list(entropy))
    else:  # token-mean
        loss = torch.cat(per_token).sum() / sum(x.numel() for x in per_token)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradient_matches_reference_and_ignores_environment_tokens(
    name: str, tiny_qwen_dir: Path, ref_dir: Path
) -> None:
    ds = DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant", lr=1e-3, grad_clip=0.0)
    cfg = LearnerConfig(model=str(tiny_qwen_dir), ref_model=str(ref_dir), ds=ds, algo=CONFIGS[name], total_steps=2)
    trainer = RLTrainer(cfg)
    batch = episodes()
    got = learner_gradient(trainer, batch)
    want = reference_gradient(name, tiny_qwen_dir, ref_dir, batch)
    assert got.keys() == want.keys()
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 1e-4  # a real gradient
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5 * scale, msg=n)

    garbage = learner_gradient(trainer, episodes(env_logprob=-2.0))
    for n in got:
        assert torch.equal(garbage[n], got[n]), n

    unmasked = learner_gradient(trainer, episodes(unmask_env=True))
    assert any(not torch.allclose(unmasked[n], got[n], rtol=1e-3, atol=1e-3 * scale) for n in got)
