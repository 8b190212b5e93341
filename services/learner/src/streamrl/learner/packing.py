"""Pure layout of tokenized samples into model rows: one sample per row (padded) or several packed per row.

A packed row holds whole samples back to back. Isolation between them comes from two things:

* ``position_ids`` restart at 0 for every sample. With no 2-D attention mask, Hugging Face models
  (``masking_utils.find_packed_sequence_indices``) turn a restart into a block-diagonal causal mask
  for sdpa/eager, and into per-sample ``cu_seqlens`` for flash-attention, so a token never sees
  another sample. The padding tail of a row is its own segment.
* ``targets`` are next-token targets computed *per sample* (``targets[t] = labels[t+1]``), so the
  last token of one sample is never trained to predict the first token of the next.

With both, the summed loss of a packed row equals the summed loss of its samples run one by one.

:func:`flatten_rows` lays rows end to end as the single row of a varlen forward
(:mod:`streamrl.learner.varlen_attention`): every sample is a sequence of its own, delimited by
``cu_seqlens``, and no position is padding except the tails that packed rows already carry.
Placement is best-fit decreasing: samples are taken longest first (ties in input order) and each
goes to the open row with the least room that still fits it. Deterministic, O(n log n), and close
to optimal on mixed lengths.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from streamrl.learner.logprobs import IGNORE_INDEX


@dataclass(frozen=True, slots=True)
class Sample:
    """One tokenized training sequence; ``labels`` align with ``input_ids`` (IGNORE_INDEX = no loss)."""

    input_ids: list[int]
    labels: list[int]


@dataclass(frozen=True, slots=True)
class Row:
    """One model input row: token ids, position ids and next-token targets, all the same length."""

    input_ids: list[int]
    position_ids: list[int]
    targets: list[int]


def next_token_targets(labels: list[int]) -> list[int]:
    """``targets[t] = labels[t+1]``; the last position has no target."""
    return [*labels[1:], IGNORE_INDEX]


def sample_row(sample: Sample) -> Row:
    """A row holding exactly one sample (no padding; ``collate`` pads)."""
    return Row(list(sample.input_ids), list(range(len(sample.input_ids))), next_token_targets(sample.labels))


def plan_packing(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Group sample indices into rows of at most ``seq_len`` tokens (best fit decreasing)."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # sorted (free tokens, row index) of rows that are still open
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        if n > seq_len:
            raise ValueError(f"sample {i} has {n} tokens, more than the packed row length {seq_len}")
        if n == 0:
            continue
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            free, r = room.pop(k)
            rows[r].append(i)
            if free - n > 0:
                bisect.insort(room, (free - n, r))
        else:
            rows.append([i])
            if seq_len - n > 0:
                bisect.insort(room, (seq_len - n, len(rows) - 1))
    return rows


def pack_row(samples: list[Sample], seq_len: int, pad_id: int) -> Row:
    """Concatenate ``samples`` into one row of exactly ``seq_len`` tokens (padding tail = its own segment)."""
    input_ids: list[int] = []
    position_ids: list[int] = []
    targets: list[int] = []
    for s in samples:
        input_ids += s.input_ids
        position_ids += range(len(s.input_ids))
        targets += next_token_targets(s.labels)
    pad = seq_len - len(input_ids)
    if pad < 0:
        raise ValueError(f"samples hold {len(input_ids)} tokens, more than the row length {seq_len}")
    return Row(input_ids + [pad_id] * pad, position_ids + list(range(pad)), targets + [IGNORE_INDEX] * pad)


def pack_samples(samples: list[Sample], seq_len: int, pad_id: int) -> list[Row]:
    """Pack ``samples`` into rows of ``seq_len`` tokens."""
    plan = plan_packing([len(s.input_ids) for s in samples], seq_len)
    return [pack_row([samples[i] for i in group], seq_len, pad_id) for group in plan]


def collate(rows: list[Row], pad_id: int, packed: bool) -> dict[str, torch.Tensor]:
    """Stack rows into model inputs plus ``targets``.

    Packed rows (all the same length) give ``input_ids, position_ids, targets`` and *no* attention
    mask (the model derives the per-sample mask from the position restarts). Single-sample rows are
    right-padded to the longest and give ``input_ids, attention_mask, targets``.
    """
    if packed:
        if len({len(r.input_ids) for r in rows}) != 1:
            raise ValueError("packed rows must all have the same length")
        return {
            "input_ids": torch.tensor([r.input_ids for r in rows], dtype=torch.long),
            "position_ids": torch.tensor([r.position_ids for r in rows], dtype=torch.long),
            "targets": torch.tensor([r.targets for r in rows], dtype=torch.long),
        }
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        mask[i, :n] = 1
        targets[i, :n] = torch.tensor(r.targets)
    return {"input_ids": ids, "attention_mask": mask, "targets": targets}


@dataclass(frozen=True)
class FlatRows:
    """Rows laid end to end: the inputs of one varlen forward, and where each row's tokens went."""

    input_ids: torch.Tensor
    """[1, n] int64: every row's tokens, row after row."""
    position_ids: torch.Tensor
    """[1, n] int64: restarting at 0 with every sample (and every packed padding tail)."""
    targets: torch.Tensor
    """[n] int64 next-token targets (IGNORE_INDEX where none)."""
    cu_seqlens: torch.Tensor
    """[sequences + 1] int32: where each sequence starts in the n tokens, then n."""
    max_seqlen: int
    """Length of the longest sequence."""
    row_lengths: list[int]
    """Tokens of each row, in order."""


def segment_lengths(position_ids: Sequence[int]) -> list[int]:
    """Lengths of the sequences of one row, split where the position ids restart at 0."""
    starts = [i for i, p in enumerate(position_ids) if p == 0 or i == 0]
    return [b - a for a, b in zip(starts, [*starts[1:], len(position_ids)], strict=True)]


def flatten_rows(rows: Sequence[Row]) -> FlatRows:
    """Lay ``rows`` (single samples or packed rows) end to end; a packed row's padding tail stays a sequence of its own."""
    if not rows:
        raise ValueError("flatten_rows needs at least one row")
    ids: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    lengths: list[int] = []
    for r in rows:
        ids += r.input_ids
        positions += r.position_ids
        targets += r.targets
        lengths += segment_lengths(r.position_ids)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return FlatRows(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        cu_seqlens=cu,
        max_seqlen=max(lengths),
        row_lengths=[len(r.input_ids) for r in rows],
    )


def unflatten(values: torch.Tensor, row_lengths: Sequence[int], fill: float = 0.0) -> torch.Tensor:
    """``[n]`` per-token values of flattened rows back to ``[rows, longest]``, ``fill`` after each row's end."""
    width = max(row_lengths)
    out = values.new_full((len(row_lengths), width), fill)
    keep = torch.arange(width)[None, :] < torch.tensor(list(row_lengths))[:, None]
    if values.device.type == "cuda":  # pinned and non-blocking: a pageable copy would wait for the GPU
        keep = keep.pin_memory().to(values.device, non_blocking=True)
    out[keep] = values
    return out
