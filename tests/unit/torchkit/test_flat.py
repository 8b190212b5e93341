"""Flat weight buffers (streamrl.torchkit.flat) on CPU tensors: layout, typed views, the block checksum.

The learner packs and hashes its CUDA IPC / broadcast buffers with these functions and every
receiver verifies with the same ones; the checksum is checked against its documented definition.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcTensor
from streamrl.torchkit.flat import BLOCK_BYTES, plan_layout, tensor_views, weights_checksum


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(50, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.k_proj.weight", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(16, generator=g)),
        ("model.norm.weight", torch.randn(16, generator=g)),
    ]


def _packed(named: list[tuple[str, torch.Tensor]], bucket_bytes: int = 2**20) -> list[torch.Tensor]:
    layout, sizes = plan_layout(named, bucket_bytes)
    buffers = [torch.zeros(size, dtype=torch.uint8) for size in sizes]
    for view, (_, tensor) in zip(tensor_views(buffers, layout), named, strict=True):
        view.copy_(tensor)
    return buffers


def _reference_checksum(buffers: list[torch.Tensor], version: int) -> str:
    """The documented definition, slowly, in Python integers."""
    sums = []
    for b in buffers:
        words = b.numpy().view(np.int32).astype(np.int64).reshape(-1, BLOCK_BYTES // 4)
        sums += [int(s) % 2**32 for s in words.sum(axis=1)]
    plain = sum(sums)
    mixed = sum((s * ((((b + 1) * 0x9E3779B1) % 2**31) | 1)) % 2**32 for b, s in enumerate(sums))
    return f"v{version}:{plain:x}:{mixed:x}"


def test_layout_keeps_one_dtype_per_buffer_aligned_and_bounded() -> None:
    named = [*_weights(0), ("big", torch.empty(3000, 4, dtype=torch.bfloat16))]  # 24000 bytes > bucket
    layout, sizes = plan_layout(named, bucket_bytes=3 * BLOCK_BYTES)
    assert [t.name for t in layout] == [n for n, _ in named]
    dtypes: dict[int, set[str]] = {}
    for t, (_, tensor) in zip(layout, named, strict=True):
        assert t.offset_bytes % BLOCK_BYTES == 0 and t.shape == list(tensor.shape)
        assert t.offset_bytes + tensor.numel() * tensor.element_size() <= sizes[t.buffer]
        dtypes.setdefault(t.buffer, set()).add(t.dtype)
    assert all(len(d) == 1 for d in dtypes.values())
    assert all(s % BLOCK_BYTES == 0 for s in sizes)
    big = layout[-1]
    assert sizes[big.buffer] == 24576 and big.offset_bytes == 0  # a tensor over the bucket size: a buffer of its own
    assert all(s <= 3 * BLOCK_BYTES for i, s in enumerate(sizes) if i != big.buffer)
    spans = sorted((t.buffer, t.offset_bytes) for t in layout)
    assert len(set(spans)) == len(spans)


def test_layout_rejects_nothing_and_duplicates() -> None:
    with pytest.raises(ValueError, match="no tensors"):
        plan_layout([], bucket_bytes=BLOCK_BYTES)
    with pytest.raises(ValueError, match="unique"):
        plan_layout(_weights(0)[:1] * 2, bucket_bytes=BLOCK_BYTES)


def test_views_read_back_every_packed_tensor() -> None:
    named = _weights(0)
    layout, _ = plan_layout(named, bucket_bytes=2 * BLOCK_BYTES)
    buffers = _packed(named, bucket_bytes=2 * BLOCK_BYTES)
    for view, (_, tensor) in zip(tensor_views(buffers, layout), named, strict=True):
        assert view.dtype == tensor.dtype and torch.equal(view, tensor)


def test_an_unknown_dtype_is_a_weight_sync_error() -> None:
    buffers = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8)]
    with pytest.raises(WeightSyncError, match="unknown dtype 'nn'"):
        tensor_views(buffers, [IpcTensor("w", "nn", [2], 0, 0)])


def test_checksum_matches_the_documented_definition() -> None:
    assert weights_checksum(_packed(_weights(0)), 7) == _reference_checksum(_packed(_weights(0)), 7)
    buffers = [torch.randint(0, 256, (3 * BLOCK_BYTES,), dtype=torch.uint8) for _ in range(2)]
    assert weights_checksum(buffers, 1) == _reference_checksum(buffers, 1)


def test_checksum_detects_a_flipped_bit_swapped_tensors_and_another_version() -> None:
    buffers = _packed(_weights(0))
    checksum = weights_checksum(buffers, 1)
    assert weights_checksum(buffers, 2) != checksum  # same bytes, another version
    flipped = [b.clone() for b in buffers]
    flipped[0][5000] ^= 1  # one bit of one byte
    assert weights_checksum(flipped, 1) != checksum
    swapped = _weights(0)  # q_proj and k_proj (same shape and dtype) trade places
    (_, q), (_, k) = swapped[1], swapped[3]
    swapped[1], swapped[3] = (swapped[1][0], k), (swapped[3][0], q)
    assert weights_checksum(_packed(swapped), 1) != checksum
