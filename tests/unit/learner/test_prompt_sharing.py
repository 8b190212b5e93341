"""Shared-prompt forward: the same logits and gradients as the plain forward (compiled: tests/integration)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.prompt_sharing import distinct_prompts, shared_prompt_logits
from streamrl.learner.rl.batch import response_logits_index
from streamrl.learner.rl.config import LearnerConfig

PAD = 0


def grouped_rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + response`` rows: 3 samples of a 5-token prompt (responses of 1, 3 and 4
    tokens), 2 of a 3-token prompt, 1 of another 5-token prompt. Returns ids, mask, prompt and
    response lengths."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 259, (n,), generator=gen) for n in (5, 3, 5)]
    rows = [(0, 1), (0, 3), (1, 4), (0, 4), (1, 2), (2, 2)]  # (prompt, response length), groups interleaved
    width = max(len(prompts[p]) + r for p, r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        row = torch.cat([prompts[p], torch.randint(3, 259, (r,), generator=gen)])
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    prompt_lens = torch.tensor([len(prompts[p]) for p, _ in rows])
    return ids, mask, prompt_lens, torch.tensor([r for _, r in rows])


def plain_logits(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, prompt_lens: torch.Tensor, width: int
) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits
    index = response_logits_index(prompt_lens, width).clamp(max=ids.shape[1] - 1)
    return logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1]))


def test_distinct_prompts_map_every_row_to_its_prompt() -> None:
    ids, _, prompt_lens, _ = grouped_rows()
    prompts, source = distinct_prompts(ids, prompt_lens)
    assert len(prompts) == 3 and source.tolist() == [0, 0, 1, 0, 1, 2]
    assert all(prompts[s] == ids[i, : prompt_lens[i]].tolist() for i, s in enumerate(source.tolist()))


def test_shared_prompt_forward_matches_the_plain_one(tiny_qwen_dir: Path) -> None:
    ids, mask, prompt_lens, response_lens = grouped_rows()
    width = int(response_lens.max())
    valid = torch.arange(width)[None, :] < response_lens[:, None]
    weights = torch.randn(valid.shape, generator=torch.Generator().manual_seed(1)) * valid
    results = []
    for forward in (plain_logits, shared_prompt_logits):
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32)
        model.config.use_cache = False  # as the learner loads it: the shared forward asks for the cache itself
        model.train()
        logits = forward(model, ids, mask, prompt_lens, width)
        at = (prompt_lens[:, None] + torch.arange(width)[None, :]).clamp(max=ids.shape[1] - 1)
        targets = torch.where(valid, ids.gather(1, at), 0)  # response token t sits at P + t
        logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, :, None]).squeeze(-1)
        (logp * weights).sum().backward()
        results.append((logits[valid].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    for name, grad in plain_grads.items():  # gradients of the shared prompt add up over its samples
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    model.zero_grad()
    with torch.no_grad():  # a one-token width needs the prompt pass only
        torch.testing.assert_close(
            shared_prompt_logits(model, ids, mask, prompt_lens, 1), plain_logits(model, ids, mask, prompt_lens, 1)
        )


def test_shared_prompts_refuse_gradient_checkpointing() -> None:
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        LearnerConfig(model="m", share_prompts=True, ds=DeepSpeedConfig(gradient_checkpointing=True))
