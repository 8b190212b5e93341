"""The vLLM engine refuses weights published only as CUDA IPC buffers and says what to set (importing
vLLM starts processes, hence the integration tier)."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcWeights
from streamrl.torchkit.flat import BLOCK_BYTES


def test_the_vllm_engine_refuses_ipc_only_weights_and_says_to_use_zmq() -> None:
    from streamrl.rollout.engines.vllm_engine import VLLMEngine

    engine = object.__new__(VLLMEngine)  # never started: the refusal comes before the engine is used
    ipc = IpcWeights(device_uuid="u", block_bytes=BLOCK_BYTES, buffers=[], tensors=[])
    with pytest.raises(WeightSyncError, match=r"set learner\.weights_transport = 'zmq'"):
        asyncio.run(engine.update_weights("", 1, "v1:0:0", 5.0, ipc=ipc))
