"""The tensors one model forward reads: :class:`RLBatch` and a row's image inputs (pure; no model, no I/O).

The model layer (:mod:`streamrl.learner.lm_forward`, :mod:`streamrl.learner.vision`) takes these and
nothing of the RL layer; :func:`streamrl.learner.rl.batch.collate` builds them from a training batch.

Layout: one row per sample, ``input_ids = prompt + response`` right-padded to the longest row.
Response-space tensors are ``[B, T]`` with ``T`` = the longest response: position ``t`` is the
``t``-th response token, predicted by the logits at input position ``P_i + t - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PixelInputs = dict[str, torch.Tensor]
"""One row's model inputs besides ``input_ids``: the processor's image tensors (a batch of one) and any
per-token input rebuilt for the row's ids."""


@dataclass
class RLBatch:
    """The tensors of a training batch, or of one micro-batch of it."""

    input_ids: torch.Tensor
    """[B, L] int64, right-padded with ``pad_id``."""
    attention_mask: torch.Tensor
    """[B, L] int64."""
    prompt_lens: torch.Tensor
    """[B] int64."""
    response_ids: torch.Tensor
    """[B, T] int64 (0 on padding)."""
    mask: torch.Tensor
    """[B, T] float32 loss mask (trajectory loss mask, 0 on padding)."""
    behaviour_logprobs: torch.Tensor
    """[B, T] float32 log-probs from the rollout engine."""
    rewards: torch.Tensor
    """[B] float32 scalar return of each sample (the sum of its turn rewards in multi-turn episodes)."""
    turn_rewards: torch.Tensor
    """[B, T] float32 rewards of each multi-turn sample's turns before the last, each on the last model
    token (``mask`` 1) at or before its turn's end; 0 elsewhere and for single-turn samples."""
    group_index: torch.Tensor
    """[B] int64 group ids (dense, 0..num_groups-1)."""
    temperatures: torch.Tensor
    """[B] float32 sampling temperature of each sample."""
    truncated: torch.Tensor
    """[B] bool."""
    pixels: tuple[PixelInputs | None, ...] = ()
    """Per row, the model's image inputs besides the ids (``pixel_values`` ...; None for a row without
    images); empty when no row has images."""

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def has_images(self) -> bool:
        """Whether a row holds images (its forward needs the pixel inputs)."""
        return any(p is not None for p in self.pixels)

    def select(self, rows: torch.Tensor | list[int]) -> RLBatch:
        idx = torch.as_tensor(rows, dtype=torch.long)
        tensors = {name: getattr(self, name)[idx] for name in self.__dataclass_fields__ if name != "pixels"}
        pixels = tuple(self.pixels[i] for i in idx.tolist()) if self.pixels else ()
        return RLBatch(**tensors, pixels=pixels)
