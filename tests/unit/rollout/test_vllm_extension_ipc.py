"""The vLLM worker extension's stage call without a GPU: what it answers the engine when it cannot
stage a version (the engine then fails the update with that reason and loads nothing)."""

from __future__ import annotations

from contextlib import ExitStack

import torch

from streamrl.common.codec import encode
from streamrl.common.messages import IpcBuffer, IpcTensor, IpcWeights
from streamrl.rollout.weights.vllm_extension import WorkerWeights
from streamrl.torchkit.testing import weights_event


class _Worker(WorkerWeights):
    """What vLLM's worker gives the extension: its device and rank (here a CPU worker)."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.rank = 0


def _ipc_event() -> bytes:
    buffer = IpcBuffer(b"h", 4096, 0, b"r", 0, b"e", False)
    ipc = IpcWeights("GPU-1", 4096, [buffer], [IpcTensor("w", "float32", [4], 0, 0)])
    return encode(weights_event(3, transport="ipc", checksum="v3:0:0", ipc=ipc))


def test_a_worker_without_cuda_answers_why_and_stages_nothing() -> None:
    worker = _Worker()
    version, answer = worker.streamrl_stage_weights(_ipc_event(), 5.0, 1)
    assert version == -1 and answer is not None and "need a CUDA device" in answer
    assert worker._streamrl_staged is None


def test_bytes_that_are_not_an_event_are_refused_not_raised() -> None:
    worker = _Worker()
    worker._streamrl_staged = (2, [], ExitStack())  # a version staged before: dropped, never loaded by mistake
    version, answer = worker.streamrl_stage_weights(b"\x93junk", 5.0, 1)
    assert version == -1 and answer is not None and "PoisonMessageError" in answer
    assert worker._streamrl_staged is None
