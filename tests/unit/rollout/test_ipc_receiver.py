"""CUDA IPC weights, rollout side, on CPU tensors: the receiver's checksum and views are the learner's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcTensor, IpcWeights
from streamrl.learner.rl import ipc_weights as learner_ipc
from streamrl.rollout import ipc_weights as rollout_ipc


def _published() -> learner_ipc.IpcWeightPublisher:
    g = torch.Generator().manual_seed(0)
    named = [
        ("model.embed_tokens.weight", torch.randn(40, 8, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(8, 24, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(8, generator=g)),
    ]
    publisher = learner_ipc.IpcWeightPublisher(bucket_bytes=learner_ipc.BLOCK_BYTES)
    publisher.pack(named, version=0)
    return publisher


def test_receiver_checksum_equals_the_learners() -> None:
    publisher = _published()
    buffers = publisher._buffers
    for version in (0, 5):
        expected = learner_ipc.weights_checksum(buffers, version)
        assert rollout_ipc.weights_checksum(buffers, version, learner_ipc.BLOCK_BYTES) == expected
    staged = [b.clone() for b in buffers]
    staged[-1][-1] ^= 0x80
    assert rollout_ipc.weights_checksum(staged, 0, learner_ipc.BLOCK_BYTES) != learner_ipc.weights_checksum(buffers, 0)


def test_receiver_views_equal_the_learners() -> None:
    publisher = _published()
    mine = rollout_ipc.tensor_views(publisher._buffers, publisher._layout)
    theirs = learner_ipc.tensor_views(publisher._buffers, publisher._layout)
    assert [t.name for t in publisher._layout][-1] == "lm_head.weight"
    for a, b in zip(mine, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_an_unknown_dtype_is_a_weight_sync_error() -> None:
    buffers = [torch.zeros(learner_ipc.BLOCK_BYTES, dtype=torch.uint8)]
    with pytest.raises(WeightSyncError, match="unknown dtype 'nn'"):
        rollout_ipc.tensor_views(buffers, [IpcTensor("w", "nn", [2], 0, 0)])


def test_the_receiver_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="need a CUDA device"):
        rollout_ipc.IpcWeightReceiver("cpu")


def test_the_vllm_engine_refuses_ipc_only_weights_and_says_to_use_zmq() -> None:
    from streamrl.rollout.vllm_engine import VLLMEngine

    engine = object.__new__(VLLMEngine)  # never started: the refusal comes before the engine is used
    ipc = IpcWeights(device_uuid="u", block_bytes=learner_ipc.BLOCK_BYTES, buffers=[], tensors=[])
    with pytest.raises(WeightSyncError, match=r"set learner\.weights_transport = 'zmq'"):
        asyncio.run(engine.update_weights("", 1, "v1:0:0", 5.0, ipc=ipc))
