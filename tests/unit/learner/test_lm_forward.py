"""The learner's flat (unpadded, varlen) forwards with the fused head give the per-token log-probs,
entropies and gradients of the plain padded forward through full logits (tiny Qwen2, CPU, float32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.common.messages import SamplingParams, ScoredTrajectory, Tensor, TrainingBatch, Trajectory
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.engine import ModelEngine
from streamrl.learner.lm_forward import flatten_padded, rl_response_logprobs, rows_logprobs, rows_nll
from streamrl.learner.logprobs import IGNORE_INDEX, entropy, token_logprobs
from streamrl.learner.offline.losses import masked_nll
from streamrl.learner.packing import Sample, collate, pack_samples, sample_row
from streamrl.learner.rl.batch import collate as rl_collate
from streamrl.learner.rl.trainer import response_logits
from streamrl.learner.varlen_attention import ATTN_NAME, register

CFG = DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant")


@pytest.fixture(scope="module")
def engine(tiny_qwen_dir: Path) -> torch.nn.Module:
    """The tiny model as the learner loads it, plain (DeepSpeed's engine refuses the direct
    ``tensor.backward()`` calls of the gradient comparisons; the forwards take either)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32, attn_implementation=register())
    model.config.use_cache = False
    return model.train()


def test_the_engine_loads_the_model_with_the_varlen_backend(tiny_qwen_dir: Path) -> None:
    engine = ModelEngine.from_config(str(tiny_qwen_dir), CFG)
    assert engine.module.config._attn_implementation == ATTN_NAME
    sdpa = ModelEngine.from_config(str(tiny_qwen_dir), CFG.model_copy(update={"attn_implementation": "sdpa"}))
    assert sdpa.module.config._attn_implementation == "sdpa"


def sft_samples(seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in (7, 3, 12, 5, 9):
        ids = torch.randint(3, 259, (n,), generator=gen).tolist()
        out.append(Sample(ids, [IGNORE_INDEX] * (n // 3) + ids[n // 3 :]))
    return out


def _padded_reference(engine: torch.nn.Module, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = collate([sample_row(s) for s in samples], pad_id=0, packed=False)
    targets = batch.pop("targets")
    return token_logprobs(engine(**batch).logits, targets), targets != IGNORE_INDEX


def _grads(engine: torch.nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in engine.parameters()]
    engine.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("head", ["fused", "full"])
def test_single_sample_rows_match_the_padded_forward(engine: torch.nn.Module, head: str) -> None:
    samples = sft_samples()
    cfg = CFG.model_copy(update={"logprob_head": head, "head_chunk_tokens": 5})
    logp, mask = rows_logprobs(engine, [sample_row(s) for s in samples], cfg)
    ref_logp, ref_mask = _padded_reference(engine, samples)
    assert torch.equal(mask, ref_mask)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    masked_nll(logp, mask).backward()
    got = _grads(engine)
    masked_nll(ref_logp, ref_mask).backward()
    for a, b in zip(got, _grads(engine), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("head", ["fused", "full"])
def test_packed_rows_give_the_loss_and_gradients_of_the_samples_alone(engine: torch.nn.Module, head: str) -> None:
    samples = sft_samples(seed=1)
    rows = pack_samples(samples, seq_len=16, pad_id=0)
    assert len(rows) < len(samples)
    cfg = CFG.model_copy(update={"logprob_head": head, "head_chunk_tokens": 7})
    loss, tokens = rows_nll(engine, rows, cfg)
    ref_logp, ref_mask = _padded_reference(engine, samples)
    ref = masked_nll(ref_logp, ref_mask)
    assert tokens == int(ref_mask.sum())
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    loss.backward()
    got = _grads(engine)
    ref.backward()
    for a, b in zip(got, _grads(engine), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _rl_batch(seed: int = 0) -> TrainingBatch:
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(3):
        prompt = rng.integers(3, 259, size=int(rng.integers(2, 6))).astype(np.int32)
        for j in range(2):
            n = int(rng.integers(1, 6))
            traj = Trajectory(
                id=f"p{g}/{j}",
                group_id=f"p{g}",
                group_index=j,
                group_size=2,
                prompt_ids=Tensor.from_numpy(prompt),
                response_ids=Tensor.from_numpy(rng.integers(3, 259, size=n).astype(np.int32)),
                logprobs=Tensor.from_numpy(np.full(n, -5.0, dtype=np.float32)),
                loss_mask=Tensor.from_numpy(np.ones(n, dtype=np.uint8)),
                sampling=SamplingParams(temperature=[0.7, 1.0, 1.3][g]),
            )
            samples.append(ScoredTrajectory(trajectory=traj, reward=float(j)))
    return TrainingBatch(id="b", index=0, samples=samples, policy_version=0, staleness=[0] * len(samples))


@pytest.mark.parametrize("head", ["fused", "full"])
def test_rl_log_probs_and_entropies_match_the_padded_forward(engine: torch.nn.Module, head: str) -> None:
    mb = rl_collate(_rl_batch(), pad_id=0)
    inside = mb.mask > 0
    weights = torch.randn(inside.shape, generator=torch.Generator().manual_seed(3))
    cfg = CFG.model_copy(update={"logprob_head": head, "head_chunk_tokens": 4})
    logp, ent = rl_response_logprobs(engine, mb, cfg, with_entropy=True)
    assert ent is not None
    assert float(logp.detach()[~inside].abs().sum()) == 0.0 and float(ent.detach()[~inside].abs().sum()) == 0.0
    ((logp * weights).sum() + ent.sum()).backward()
    got = _grads(engine)
    logits = response_logits(engine, mb)
    ref_logp, ref_ent = token_logprobs(logits, mb.response_ids) * inside, entropy(logits) * inside
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    ((ref_logp * weights).sum() + ref_ent.sum()).backward()
    for a, b in zip(got, _grads(engine), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_flatten_padded_lays_rows_end_to_end_and_refuses_left_padding() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [1, 2, 3, 4]])
    mask = (ids != 0).long()
    flat, positions, cu, starts = flatten_padded(ids, mask)
    assert flat.tolist() == [[5, 6, 7, 8, 1, 2, 3, 4]]
    assert positions.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert cu.tolist() == [0, 3, 4, 8] and starts.tolist() == [0, 3, 4]
    with pytest.raises(ValueError, match="right-padded"):
        flatten_padded(ids, torch.tensor([[0, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]))
