"""Token sampling on the device the logits live on: no per-step host transfer.

The distribution sampled from is explicit, and the behaviour log-prob of a token is read from
exactly that distribution (what TIS / ICEPOP need, algorithms.md section 7): logits / temperature,
then top-k, then top-p (vLLM's order). Greedy rows (temperature 0) take the argmax and report the
log-softmax of the raw logits, as vLLM does.

Every row carries its own parameters (:class:`RowParams`), so rows with different sampling settings
share one batch. Sampling uses the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. is a
draw from ``p`` (the same as Gumbel-max), one elementwise pass with no sort and no host sync. The sort
that top-k / top-p need runs only when some row asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")
TINY = 1e-30
"""Floor of an Exp(1) draw (a zero would turn its log into -inf)."""


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[B, V] log-probs of the distribution sampled from, one setting for every row.

    Filtered tokens get -inf. ``temperature == 0`` (greedy) returns the raw log-softmax.
    ``top_k <= 0`` and ``top_p >= 1`` disable those filters. Top-p keeps the smallest set of most
    likely tokens whose probability reaches ``top_p`` (always at least one token).
    """
    rows = logits.shape[0]
    params = RowParams(
        temperature=torch.full((rows,), float(temperature), device=logits.device),
        top_k=torch.full((rows,), int(top_k), dtype=torch.long, device=logits.device),
        top_p=torch.full((rows,), float(top_p), device=logits.device),
        filtered=(0 < top_k < logits.shape[-1] or top_p < 1.0) and temperature > 0,
    )
    return row_logprobs(logits, params)


@dataclass
class RowParams:
    """Per-row sampling parameters, as tensors on the logits' device."""

    temperature: torch.Tensor
    """[B] float; 0 = greedy."""
    top_k: torch.Tensor
    """[B] long; <= 0 or >= V = off."""
    top_p: torch.Tensor
    """[B] float; >= 1 = off."""
    filtered: bool
    """Whether any row uses top-k or top-p (the sort runs only then)."""

    def select(self, index: torch.Tensor) -> RowParams:
        return RowParams(self.temperature[index], self.top_k[index], self.top_p[index], self.filtered)


def row_logprobs(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """[B, V] float32 log-probs of each row's sampled distribution (see the module docstring)."""
    logits = logits.float()
    greedy = params.temperature <= 0
    scale = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    scaled = logits / scale[:, None]
    if params.filtered:
        vocab = logits.shape[-1]
        k = torch.where((params.top_k <= 0) | (params.top_k >= vocab), vocab, params.top_k)
        k = torch.where(greedy, vocab, k)
        top_p = torch.where(greedy, torch.ones_like(params.top_p), params.top_p)
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)  # top-k keeps ties
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly better tokens
        drop_sorted = (sorted_logits == NEG_INF) | ((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0))
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, NEG_INF)
    return torch.log_softmax(scaled, dim=-1)


def pick(logp: torch.Tensor, greedy: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logp`` [B, V]; greedy rows take the argmax.

    ``noise`` [B, V] holds i.i.d. Exp(1) draws. Returns (token ids [B], their log-probs [B]).
    """
    race = logp - torch.log(noise.clamp_min(TINY))  # argmax(p / E) = argmax(log p - log E)
    ids = torch.where(greedy, logp.argmax(dim=-1), race.argmax(dim=-1))
    return ids, logp.gather(1, ids[:, None]).squeeze(1)


def exponential_noise(
    shape: tuple[int, int],
    device: torch.device,
    generator: torch.Generator | None,
    row_generators: dict[int, torch.Generator] | None = None,
) -> torch.Tensor:
    """[B, V] Exp(1) draws from ``generator``; rows in ``row_generators`` draw from their own."""
    noise = torch.empty(shape, device=device).exponential_(generator=generator)
    for row, gen in (row_generators or {}).items():
        noise[row].exponential_(generator=gen)
    return noise
