"""Shared-prompt forward: each distinct prompt of a micro-batch runs through the model once, and
the responses of its samples run on top of its KV cache.

A GRPO / RLOO group is n samples of one prompt, so the plain layout (every row = prompt +
response) computes each prompt n times. Here::

    prompts   [U, P]  left-padded distinct prompts          -> logits of the last prompt position
                                                               (they predict response token 0)
    cache     [U, ...] -> rows copied to each sample        (indexing: gradients flow back and add up)
    responses [B, T-1] tokens 0..T-2 on that cache          -> logits predicting tokens 1..T-1

Exact: a response token attends to the same prompt keys and values at the same positions as in
the plain layout (measured equal to the last bit on CPU float32). For the 0.66M-parameter demo
(6-token prompts, <= 4-token answers, 32 x 8 samples) a compiled training step took 0.111 s
instead of 0.151 s. Needs a model that returns its KV cache in training mode, so not with
gradient checkpointing (transformers turns the cache off there).
"""

from __future__ import annotations

from typing import Any

import torch


def distinct_prompts(input_ids: torch.Tensor, prompt_lens: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """The distinct prompts of right-padded rows, and for each row the index of its prompt."""
    index: dict[tuple[int, ...], int] = {}
    rows = input_ids.tolist()
    source = [index.setdefault(tuple(row[:n]), len(index)) for row, n in zip(rows, prompt_lens.tolist(), strict=True)]
    return [list(p) for p in index], torch.tensor(source, dtype=torch.long)


def shared_prompt_logits(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lens: torch.Tensor, width: int
) -> torch.Tensor:
    """[B, width, V] logits predicting response tokens ``0..width-1`` of right-padded ``prompt + response``
    rows, computing each distinct prompt once (see the module docstring)."""
    prompts, source = distinct_prompts(input_ids, prompt_lens)
    longest = max(len(p) for p in prompts)
    prompt_ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for u, p in enumerate(prompts):
        prompt_ids[u, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_mask[u, longest - len(p) :] = 1
    positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True)
    cache = out.past_key_values
    if cache is None:
        raise RuntimeError(
            "the model returned no KV cache in training mode (gradient checkpointing turns it off): "
            "set learner.share_prompts = false"
        )
    on_device = source.to(out.logits.device)
    first = out.logits[:, -1:][on_device]
    if width == 1:
        return first
    cache.batch_select_indices(on_device)
    ids, prompt_lens = input_ids.cpu(), prompt_lens.cpu()
    steps = torch.arange(width - 1)
    response_mask = (steps[None, :] < (attention_mask.sum(dim=1).cpu() - prompt_lens)[:, None]).long()
    response_positions = prompt_lens[:, None] + steps[None, :]
    responses = ids.gather(1, response_positions.clamp(max=ids.shape[1] - 1)) * response_mask
    rest = model(
        input_ids=responses,
        attention_mask=torch.cat([prompt_mask[source], response_mask], dim=1),
        position_ids=response_positions,
        past_key_values=cache,
        use_cache=True,
    ).logits
    return torch.cat([first, rest], dim=1)
