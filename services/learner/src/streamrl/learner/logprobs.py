"""Pure per-token log-probability and entropy helpers on logits.

Conventions: ``logits`` is ``(..., T, V)`` and ``targets`` is ``(..., T)`` *already aligned*
(``targets[t]`` is the token that ``logits[t]`` predicts, i.e. the caller shifts by one);
``IGNORE_INDEX`` (-100) marks positions without a target, whose log-prob is returned as 0.

Memory: the vocabulary axis is the large one (151k for Qwen). The log-softmax is evaluated in
row chunks, each upcast to float32 on its own, so no full float32 copy of a bf16 logits tensor is
made in the forward pass (autograd still keeps what the backward needs).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
_CHUNK_ROWS = 4096


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(targets[t] | logits[t] / temperature) as float32 of shape ``targets.shape``; 0 where ignored."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not align")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    valid = flat_targets != IGNORE_INDEX
    safe_targets = torch.where(valid, flat_targets, torch.zeros_like(flat_targets))
    pieces = []
    for start in range(0, flat_logits.shape[0], _CHUNK_ROWS):
        chunk = flat_logits[start : start + _CHUNK_ROWS].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = chunk.gather(-1, safe_targets[start : start + _CHUNK_ROWS, None]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(chunk, dim=-1))
    out = torch.cat(pieces) if pieces else flat_logits.new_zeros(0, dtype=torch.float32)
    return torch.where(valid, out, torch.zeros_like(out)).reshape(targets.shape)


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats, float32) of softmax(logits / temperature) at every position: shape ``logits.shape[:-1]``."""
    flat = logits.reshape(-1, logits.shape[-1])
    pieces = []
    for start in range(0, flat.shape[0], _CHUNK_ROWS):
        chunk = flat[start : start + _CHUNK_ROWS].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        logp = torch.log_softmax(chunk, dim=-1)
        pieces.append(-(logp.exp() * logp).sum(-1))
    out = torch.cat(pieces) if pieces else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


def shift_targets(labels: torch.Tensor) -> torch.Tensor:
    """Turn Hugging Face-style labels (aligned with input ids) into next-token targets: ``targets[t] = labels[t+1]``."""
    pad = torch.full_like(labels[..., :1], IGNORE_INDEX)
    return torch.cat([labels[..., 1:], pad], dim=-1)
