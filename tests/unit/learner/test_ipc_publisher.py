"""CUDA IPC weights, learner side, on CPU tensors: layout, device-side checksum, packing into buffers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from streamrl.torchkit.flat import BLOCK_BYTES, plan_layout, tensor_views, weights_checksum
from streamrl.torchkit.weights.ipc import IpcPublisher


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(50, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.k_proj.weight", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(16, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(64, 16, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(16, generator=g)),
    ]


def test_checksum_detects_a_flipped_byte_swapped_tensors_and_a_stale_version() -> None:
    publisher = IpcPublisher(bucket_bytes=2**20)
    checksum = publisher.pack(_weights(0), version=1)
    buffers = [b.clone() for b in publisher._buffers]
    assert weights_checksum(buffers, 1) == checksum
    assert weights_checksum(buffers, 2) != checksum  # same bytes, another version
    buffers[0][5000] ^= 1  # one bit of one byte
    assert weights_checksum(buffers, 1) != checksum
    swapped = _weights(0)  # q_proj and k_proj (same shape and dtype) trade places
    (_, q), (_, k) = swapped[1], swapped[3]
    swapped[1], swapped[3] = (swapped[1][0], k), (swapped[3][0], q)
    assert IpcPublisher(bucket_bytes=2**20).pack(swapped, version=1) != checksum
    assert publisher.pack(_weights(1), version=2) != weights_checksum(buffers, 2)  # new weights, new digest


def test_pack_copies_every_version_and_sends_the_tied_head() -> None:
    publisher = IpcPublisher(bucket_bytes=2 * BLOCK_BYTES)
    for version, seed in [(0, 0), (1, 1)]:
        named = _weights(seed)
        publisher.pack(iter(named), version)  # later versions are streamed
        names = [t.name for t in publisher._layout]
        assert names == [n for n, _ in named] + ["lm_head.weight"]
        views = dict(zip(names, tensor_views(publisher._buffers, publisher._layout), strict=True))
        for name, tensor in named:
            assert torch.equal(views[name], tensor)
        assert torch.equal(views["lm_head.weight"], dict(named)["model.embed_tokens.weight"])
    assert publisher.num_bytes == sum(t.numel() * t.element_size() for _, t in _weights(0)) + 50 * 16 * 2


def test_pack_refuses_a_changed_layout_and_an_old_version() -> None:
    publisher = IpcPublisher(bucket_bytes=2**20)
    publisher.pack(_weights(0), version=3)
    with pytest.raises(ValueError, match="version must increase"):
        publisher.pack(_weights(0), version=3)
    with pytest.raises(ValueError, match="layout changed"):
        publisher.pack(_weights(0)[:-1], version=4)
    renamed = _weights(0)
    renamed[2] = ("model.layers.0.self_attn.q_proj.bias_x", renamed[2][1])
    with pytest.raises(ValueError, match=r"layout changed: got 'model\.layers\.0\.self_attn\.q_proj\.bias_x'"):
        publisher.pack(renamed, version=5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_publishing_cpu_tensors_over_ipc_says_to_use_zmq() -> None:
    with pytest.raises(ValueError, match="weights_transport = 'zmq'"):
        IpcPublisher().publish(_weights(0), version=0)


def test_the_benchmarks_1_5b_shaped_weights_fill_seven_512_mib_buffers() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    import gpu_weights

    shapes = gpu_weights.qwen2_shapes(**gpu_weights.QWEN2_1_5B)
    named = [(name, torch.empty(shape, dtype=torch.bfloat16, device="meta")) for name, shape in shapes]
    named.append(("lm_head.weight", named[0][1]))  # tied: sent explicitly
    layout, sizes = plan_layout(named, bucket_bytes=512 * 2**20)
    assert len(layout) == 339 and len(sizes) == 7 and max(sizes) <= 512 * 2**20
    # 3.55 GB of bf16: 1,543,714,304 parameters, plus the tied head sent again
    assert sum(t.numel() * 2 for _, t in named) == 3_554_176_000
