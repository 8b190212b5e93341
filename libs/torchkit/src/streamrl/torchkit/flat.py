"""Flat device buffers of named tensors, and their block checksum (CUDA IPC and broadcast weights).

The learner packs its weights into a few flat ``uint8`` buffers (:func:`plan_layout`: one dtype per
buffer, about ``bucket_bytes`` each, every tensor starting on a block of ``BLOCK_BYTES``) and
describes them as a list of :class:`streamrl.common.messages.IpcTensor`; a receiver that holds
buffers of the same sizes reads the tensors back as typed views (:func:`tensor_views`, no copy).
Both sides verify what the buffers hold with :func:`weights_checksum`, on the buffers' device (no
host hashing of the bytes).

Checksum: the buffers are read as int32 words in blocks of ``block_bytes``; ``s_b`` = the sum of
block ``b``'s words mod 2^32 (one reduction kernel, one read of the bytes), blocks numbered across
all buffers. Then ``plain = sum_b s_b`` and ``mixed = sum_b (s_b * w_b mod 2^32)`` with ``w_b =
((b + 1) * 0x9E3779B1 mod 2^31) | 1`` (a fixed odd pseudo-random 31-bit weight per block
position); digest ``"v{version}:{plain:x}:{mixed:x}"``. A changed word changes its block sum,
hence ``plain``; two tensors swapped (each starts on its own block) move their block sums to other
weights, which changes ``mixed``; a digest of another version never matches. Tensors and buffers
are padded with zeros to whole blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcTensor

BLOCK_BYTES = 4096
"""Alignment of every tensor in its buffer, and the checksum's block."""
_MIX = 0x9E3779B1
"""Odd 32-bit constant (golden ratio): block ``b``'s weight is ``((b + 1) * _MIX mod 2^31) | 1``."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def plan_layout(
    named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, block_bytes: int = BLOCK_BYTES
) -> tuple[list[IpcTensor], list[int]]:
    """Place ``named`` tensors in flat buffers: returns (layout in input order, buffer sizes in bytes).

    Each buffer holds one dtype and fills up to ``bucket_bytes`` (a larger tensor gets a buffer of
    its own); each tensor starts at a multiple of ``block_bytes`` and takes whole blocks (at least one).
    Only the tensors' dtype and shape are read (meta tensors will do).
    """
    if not named:
        raise ValueError("no tensors to publish")
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    layout: list[IpcTensor] = []
    sizes: list[int] = []
    open_buffer: dict[torch.dtype, int] = {}
    for name, t in named:
        padded = max(block_bytes, -(-t.numel() * t.element_size() // block_bytes) * block_bytes)
        index = open_buffer.get(t.dtype)
        if index is None or sizes[index] + padded > bucket_bytes:
            index = open_buffer[t.dtype] = len(sizes)
            sizes.append(0)
        layout.append(IpcTensor(name, dtype_name(t.dtype), list(t.shape), index, sizes[index]))
        sizes[index] += padded
    return layout, sizes


def tensor_views(buffers: Sequence[torch.Tensor], layout: Sequence[IpcTensor]) -> list[torch.Tensor]:
    """Typed views of ``layout``'s tensors into flat uint8 ``buffers`` (no copy).

    Raises :class:`WeightSyncError` for a dtype torch does not know (a layout from another version).
    """
    views = []
    for t in layout:
        dtype = getattr(torch, t.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise WeightSyncError(f"tensor {t.name!r} has an unknown dtype {t.dtype!r}")
        numel = 1
        for d in t.shape:
            numel *= d
        raw = buffers[t.buffer][t.offset_bytes : t.offset_bytes + numel * dtype.itemsize]
        views.append(raw.view(dtype).view(t.shape))
    return views


def weights_checksum(buffers: Sequence[torch.Tensor], version: int, block_bytes: int = BLOCK_BYTES) -> str:
    """Digest of flat uint8 ``buffers`` (sizes multiples of ``block_bytes``) and ``version``, computed
    on the buffers' device (see the module docstring). Waits for the device (reads two numbers)."""
    # int32 sums of int32 words: no widened copy of the bytes; mod 2^32 whatever the accumulator
    block_sums = torch.cat(
        [b.view(torch.int32).view(-1, block_bytes // 4).sum(dim=1, dtype=torch.int32) for b in buffers]
    )
    sums = block_sums.to(torch.int64) & 0xFFFFFFFF
    position = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=sums.device)
    weights = ((position * _MIX) & 0x7FFFFFFF) | 1
    plain, mixed = torch.stack([sums.sum(), ((sums * weights) & 0xFFFFFFFF).sum()]).tolist()
    return f"v{version}:{plain:x}:{mixed:x}"
