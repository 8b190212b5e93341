"""TrainingBatch -> padded tensors for the RL step (pure; no model, no I/O).

The tensors are a :class:`streamrl.learner.model_batch.RLBatch`: the model layer's input, defined
below the RL layer (which imports it, never the other way round) and re-exported here. Its module
docstring has the layout: one row per sample, ``input_ids = prompt + response`` right-padded, the
response-space tensors ``[B, T]``.

Multi-turn episodes (``Trajectory.turns``): the response holds the model's turns and the environment's
tokens between them; ``mask`` is the trajectory's loss mask (0 on environment tokens), and the
per-turn rewards (``ScoredTrajectory.turn_rewards``, the final reward already added to the last turn)
become ``turn_rewards``: every turn's reward but the last, on the last model token at or before that
turn's end. The scalar ``rewards`` stays the whole return; the estimators put what the earlier turns
did not receive on the last model token (``advantages.token_rewards``), so the final turn gets the
shaped return minus the earlier turns' rewards. docs/multiturn.md has the whole rule.

Vision-language policies: ``collate`` is handed the policy's image preparation
(:class:`streamrl.learner.vision.ImageInputs`) and keeps each row's pixel inputs in ``pixels``; a
text-only policy gets none, and a trajectory with images is then an error (never silently dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from streamrl.common.messages import ScoredTrajectory, TrainingBatch, Trajectory
from streamrl.learner.model_batch import PixelInputs, RLBatch

__all__ = [
    "ImagePreparer",
    "PixelInputs",
    "RLBatch",
    "collate",
    "micro_batches",
    "rank_share",
    "response_logits_index",
    "update_plan",
]

ImagePreparer = Callable[[Sequence[Trajectory]], list[PixelInputs | None]]
"""Turns trajectories into their rows' pixel inputs (None for a row without images), in order."""


def collate(batch: TrainingBatch, pad_id: int, images: ImagePreparer | None = None) -> RLBatch:
    """Pad every sample of ``batch`` into one :class:`RLBatch`; ``images`` prepares the pixel inputs of a
    vision-language policy (None: a text-only policy, which takes no trajectory with images)."""
    samples = batch.samples
    if not samples:
        raise ValueError(f"{batch.id} has no samples")
    trajectories = [s.trajectory for s in samples]
    pixels: tuple[PixelInputs | None, ...] = ()
    if images is not None:
        pixels = tuple(images(trajectories))
    else:
        with_images = next((t for t in trajectories if t.images), None)
        if with_images is not None:
            raise ValueError(
                f"trajectory {with_images.id} carries {len(with_images.images)} image(s) but the policy is a "
                "text-only model: train image trajectories with a vision-language checkpoint"
            )
    prompts = [s.trajectory.prompt_ids.to_numpy().astype(np.int64) for s in samples]
    responses = [s.trajectory.response_ids.to_numpy().astype(np.int64) for s in samples]
    total = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    width = max(1, max(len(r) for r in responses))
    b = len(samples)
    input_ids = np.full((b, total), pad_id, dtype=np.int64)
    attention = np.zeros((b, total), dtype=np.int64)
    response_ids = np.zeros((b, width), dtype=np.int64)
    mask = np.zeros((b, width), dtype=np.float32)
    behaviour = np.zeros((b, width), dtype=np.float32)
    turn_rewards = np.zeros((b, width), dtype=np.float32)
    groups: dict[str, int] = {}
    for i, s in enumerate(samples):
        p, r = prompts[i], responses[i]
        input_ids[i, : len(p)] = p
        input_ids[i, len(p) : len(p) + len(r)] = r
        attention[i, : len(p) + len(r)] = 1
        response_ids[i, : len(r)] = r
        mask[i, : len(r)] = s.trajectory.loss_mask.to_numpy()
        behaviour[i, : len(r)] = s.trajectory.logprobs.to_numpy()
        _place_turn_rewards(s, mask[i, : len(r)], turn_rewards[i])
        groups.setdefault(s.trajectory.group_id, len(groups))
    return RLBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
        response_ids=torch.from_numpy(response_ids),
        mask=torch.from_numpy(mask),
        behaviour_logprobs=torch.from_numpy(behaviour),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        turn_rewards=torch.from_numpy(turn_rewards),
        group_index=torch.tensor([groups[s.trajectory.group_id] for s in samples], dtype=torch.long),
        temperatures=torch.tensor([s.trajectory.sampling.temperature or 1.0 for s in samples], dtype=torch.float32),
        truncated=torch.tensor([s.trajectory.truncated for s in samples], dtype=torch.bool),
        pixels=pixels,
    )


def _place_turn_rewards(sample: ScoredTrajectory, mask: np.ndarray, out: np.ndarray) -> None:
    """Write the rewards of ``sample``'s turns before the last into ``out`` (its row of ``turn_rewards``).

    Turn ``k``'s reward goes on the last position ``p < turns[k].end`` with ``mask[p] = 1``: its last
    model token, or an earlier turn's when all of its own tokens are masked. A turn with no model token
    at or before its end leaves its reward in the final remainder (``rewards - turn_rewards.sum()``).
    """
    rewards, turns = sample.turn_rewards, sample.trajectory.turns
    if not rewards:
        return
    tid = sample.trajectory.id
    if len(rewards) != len(turns):
        raise ValueError(f"{tid}: {len(rewards)} turn_rewards for {len(turns)} turns (one reward per turn)")
    previous_end = 0
    for turn in turns:
        if not previous_end <= turn.start <= turn.end <= len(mask):
            raise ValueError(
                f"{tid}: turn [{turn.start}, {turn.end}) must follow the previous turn's end {previous_end} "
                f"and lie inside the response of {len(mask)} tokens"
            )
        previous_end = turn.end
    model_positions = np.flatnonzero(mask)
    for turn, reward in zip(turns[:-1], rewards[:-1], strict=True):
        before_end = model_positions[model_positions < turn.end]
        if before_end.size:
            out[before_end[-1]] += reward


def response_logits_index(prompt_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, T] input positions whose logits predict response token ``t``: ``P_i - 1 + t``."""
    return prompt_lens[:, None] - 1 + torch.arange(width)[None, :]


def micro_batches(size: int, num: int) -> list[list[int]]:
    """Split row indices ``0..size-1`` into exactly ``num`` contiguous, nearly equal chunks (some may be empty)."""
    return [chunk.tolist() for chunk in np.array_split(np.arange(size), num)]


def update_plan(
    group_index: torch.Tensor, *, mini_batches: int, epochs: int, grad_accum: int, seed: int
) -> list[list[list[int]]]:
    """The optimizer updates of one batch: ``plan[u][m]`` = rows of micro-batch ``m`` of update ``u``.

    ``epochs`` passes over the batch, each split into ``mini_batches`` mini-batches of whole groups
    (one optimizer step each, of ``grad_accum`` micro-batches). With one mini-batch the rows keep
    their order; otherwise every pass takes the groups in a new order drawn from ``seed``. A
    mini-batch gets no rows when the batch has fewer groups than ``mini_batches`` (its update is then
    an empty step, so that every rank takes the same number of steps).

    Example: 4 groups of 2 rows, 2 mini-batches, 1 epoch, no accumulation -> 2 updates of 4 rows each.
    """
    rows = torch.arange(group_index.numel())
    if mini_batches == 1:
        return [micro_batches(rows.numel(), grad_accum) for _ in range(epochs)]
    generator = torch.Generator().manual_seed(seed)
    num_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    plan = []
    for _ in range(epochs):
        order = torch.randperm(num_groups, generator=generator).numpy()
        for groups in np.array_split(order, mini_batches):
            picked = rows[torch.isin(group_index, torch.from_numpy(groups))].tolist()
            plan.append([[picked[i] for i in chunk] for chunk in micro_batches(len(picked), grad_accum)])
    return plan


def rank_share(rows: list[int], group_index: torch.Tensor, lengths: torch.Tensor, world: int, rank: int) -> list[int]:
    """The rows of ``rows`` that data-parallel rank ``rank`` of ``world`` trains on, in their original order.

    Whole groups are dealt out balanced by tokens (``lengths[row]``, e.g. prompt + response): the
    largest group first, each to the rank with the fewest tokens so far (ties: the lowest rank).
    With fewer groups than ranks the rows themselves are dealt out the same way. Every rank computes
    the same split; the shares are disjoint and cover ``rows``; a share may be empty.

    Example: groups of 30, 10, 10, 10 tokens on 2 ranks -> rank 0 the first group, rank 1 the other three.
    """
    if world == 1:
        return list(rows)
    units: dict[int, list[int]] = {}
    for r in rows:
        units.setdefault(int(group_index[r]), []).append(r)
    parts = list(units.values()) if len(units) >= world else [[r] for r in rows]
    tokens = [int(lengths[part].sum()) for part in parts]
    load = [0] * world
    mine: list[int] = []
    for i in sorted(range(len(parts)), key=lambda i: (-tokens[i], parts[i][0])):
        owner = min(range(world), key=lambda k: (load[k], k))
        load[owner] += tokens[i]
        if owner == rank:
            mine.extend(parts[i])
    return sorted(mine)
