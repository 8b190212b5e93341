"""The vLLM worker extension's CUDA IPC stage without a GPU: what it answers the engine when it cannot
stage a version (the engine then fails the update with that reason and loads nothing)."""

from __future__ import annotations

import torch

from streamrl.common.messages import IpcBuffer, IpcTensor, IpcWeights
from streamrl.rollout.weights.vllm_extension import WeightReceiver
from streamrl.torchkit.weights.ipc_plan import encode_ipc


class _Worker(WeightReceiver):
    """What vLLM's worker gives the extension: its device and rank (here a CPU worker)."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.rank = 0


def _ipc() -> IpcWeights:
    buffer = IpcBuffer(b"h", 4096, 0, b"r", 0, b"e", False)
    return IpcWeights("GPU-1", 4096, [buffer], [IpcTensor("w", "float32", [4], 0, 0)])


def test_a_worker_without_cuda_answers_why_and_stages_nothing() -> None:
    worker = _Worker()
    answer = worker.streamrl_stage_ipc(encode_ipc(_ipc()), 3, "v3:0:0")
    assert answer is not None and "need a CUDA device" in answer
    assert worker._streamrl_staged is None


def test_bytes_that_are_not_an_ipc_message_are_refused_not_raised() -> None:
    worker = _Worker()
    worker._streamrl_staged = (2, [])  # a version staged before: dropped, never loaded by mistake
    answer = worker.streamrl_stage_ipc(b"\x93junk", 3, "v3:0:0")
    assert answer is not None and "not an IpcWeights message" in answer
    assert worker._streamrl_staged is None
