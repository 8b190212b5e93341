"""Fused linear log-prob head: per-token log-probs (and entropies) from final hidden states without
ever holding the ``[tokens, vocabulary]`` logits.

The tokens are processed in chunks of ``chunk_tokens``: one bf16 logits buffer of ``[chunk, V]``
is filled by the output-head matmul and reduced in one pass (:mod:`streamrl.learner.head_kernels`).
Only per-token float32 statistics (log-sum-exp, entropy) are kept for the backward pass.

* :func:`linear_logprobs` - ``log softmax(h W^T / T)[target]`` per token, at a per-token
  temperature ``T``, optionally with the entropy of that distribution. Any loss may follow (PPO
  ratios, KL terms, entropy bonus), so the upstream gradient is known only in the backward pass,
  which recomputes each chunk's logits: 4 head matmuls per step instead of 3, against a full
  logits tensor (151k x tokens, upcast to float32) read and written several times.
* :func:`linear_nll` - the masked, weighted negative log-likelihood ``-sum_t w_t log p(target_t)``.
  Its gradient is linear in the (known) weights, so it is computed in the forward pass, chunk by
  chunk, and the backward pass only scales it: 3 head matmuls, as with unfused logits.

The vocabulary axis of the logits buffer is padded to a multiple of 128 (the head weight gets zero
rows for the matmuls): with an odd vocabulary (151,669 for Qwen2) the buffer's row stride is not
16-byte aligned and cuBLAS falls back to slow unaligned kernels (measured on an H200: 82 ms of a
205 ms step in them; after padding the head matmuls run at the speed of the others).

Both equal the plain computation through full logits (unit-tested on CPU in float32 and float64).
Only the raw head weight is used: the head must have no bias and must not be ZeRO-3 partitioned;
callers check :func:`fusable` and otherwise go through the head module.
"""

from __future__ import annotations

from typing import Any

import torch

from streamrl.learner.head_kernels import chunk_grad_, chunk_stats

_VOCAB_ALIGN = 128


def _padded(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[V, H]`` with zero rows appended up to a multiple of 128 rows (itself when aligned)."""
    extra = -weight.shape[0] % _VOCAB_ALIGN
    return torch.nn.functional.pad(weight, (0, 0, 0, extra)) if extra else weight


def fusable(head: Any) -> bool:
    """True when ``head`` is a plain bias-free linear layer whose weight is held whole on this rank."""
    weight = getattr(head, "weight", None)
    return (
        isinstance(head, torch.nn.Linear)
        and head.bias is None
        and weight is not None
        and not hasattr(weight, "ds_id")  # a ZeRO-3 parameter is gathered only inside its module's forward
    )


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and head weight {tuple(weight.shape)} do not match")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not align with hidden {tuple(hidden.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        inv_t: torch.Tensor,
        with_entropy: bool,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, ...]:
        n, vocab = hidden.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logp = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else None
        w = _padded(weight)
        buffer = torch.empty((min(chunk_tokens, n), w.shape[0]), dtype=hidden.dtype, device=hidden.device)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            z = torch.mm(hidden[s:e], w.t(), out=buffer[: e - s])[:, :vocab]
            lse[s:e], logp[s:e], ent = chunk_stats(z, targets[s:e], inv_t[s:e], with_entropy)
            if entropy is not None and ent is not None:
                entropy[s:e] = ent
        ctx.save_for_backward(hidden, weight, targets, inv_t, lse, entropy)
        ctx.chunk_tokens = chunk_tokens
        return (logp, entropy) if entropy is not None else (logp,)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, inv_t, lse, entropy = ctx.saved_tensors
        g_lp = grads[0]
        g_ent = grads[1] if entropy is not None else None
        n, chunk, vocab = hidden.shape[0], ctx.chunk_tokens, weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = _padded(weight)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        buffer = torch.empty((min(chunk, n), w.shape[0]), dtype=hidden.dtype, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e]
            z = torch.mm(h, w.t(), out=buffer[: e - s])  # padded columns: h @ 0 = 0, so they add nothing below
            chunk_grad_(
                z[:, :vocab],
                targets[s:e],
                inv_t[s:e],
                lse[s:e],
                g_lp[s:e],
                None if entropy is None else entropy[s:e],
                None if g_ent is None else g_ent[s:e],
            )
            if grad_h is not None:
                torch.mm(z, w, out=grad_h[s:e])
            if grad_w is not None:
                grad_w += torch.mm(z.t(), h).float()
        return grad_h, None if grad_w is None else grad_w[:vocab].to(weight.dtype), None, None, None, None


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor | None = None,
    with_entropy: bool = False,
    chunk_tokens: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``log softmax(hidden @ weight.T / temperature)[targets]`` (float32, 0 where target < 0)
    and, with ``with_entropy``, the entropy of each of those distributions.

    ``hidden`` ``[N, H]``, ``weight`` ``[V, H]`` (the output embedding), ``targets`` ``[N]``,
    ``temperature`` ``[N]`` (None = 1). Differentiable in ``hidden`` and ``weight``.
    """
    _check(hidden, weight, targets, chunk_tokens)
    inv_t = (
        torch.ones(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        if temperature is None
        else (1.0 / temperature.float()).to(hidden.device)
    )
    out = _LinearLogprobs.apply(hidden, weight, targets.to(hidden.device), inv_t, with_entropy, chunk_tokens)
    return out[0], (out[1] if with_entropy else None)


class _LinearNLL(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, chunk: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, vocab = hidden.shape[0], weight.shape[0]
        ones = torch.ones(n, dtype=torch.float32, device=hidden.device)
        logp = torch.empty_like(ones)
        w = _padded(weight)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        buffer = torch.empty((min(chunk, n), w.shape[0]), dtype=hidden.dtype, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e]
            z = torch.mm(h, w.t(), out=buffer[: e - s])  # padded columns: h @ 0 = 0, so they add nothing below
            lse, logp[s:e], _ = chunk_stats(z[:, :vocab], targets[s:e], ones[s:e], False)
            chunk_grad_(z[:, :vocab], targets[s:e], ones[s:e], lse, -weights[s:e])
            torch.mm(z, w, out=grad_h[s:e])
            grad_w += torch.mm(z.t(), h).float()
        ctx.save_for_backward(grad_h, grad_w[:vocab].to(weight.dtype))
        ctx.mark_non_differentiable(logp)
        loss = -(logp * weights).sum()
        return loss, logp

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_logp: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss.to(grad_h.dtype)
        return grad_h * scale, grad_w * scale, None, None, None


def linear_nll(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, chunk_tokens: int = 8192
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(-sum_t weights_t * log p(targets_t), per-token log-probs detached)`` through the head ``weight``.

    ``weights`` ``[N]`` (float32; e.g. mask / token count for a token-mean loss); targets < 0 count 0.
    With gradients enabled, the gradient is formed chunk by chunk in this forward call.
    """
    _check(hidden, weight, targets, chunk_tokens)
    targets, weights = targets.to(hidden.device), weights.float().to(hidden.device)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss, logp = _LinearNLL.apply(hidden, weight, targets, weights, chunk_tokens)
        return loss, logp
    logp, _ = linear_logprobs(hidden, weight, targets, chunk_tokens=chunk_tokens)
    return -(logp * weights).sum(), logp
