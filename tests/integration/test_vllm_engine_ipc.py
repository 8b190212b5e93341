"""The vLLM engine on a GPU takes colocated weights over CUDA IPC and sleeps between versions
(skipped without CUDA; on vLLM's CPU build the refusals are tests/integration/rollout/test_vllm_ipc_refusal.py).

A spawned process plays the learner and publishes with ``IpcPublisher``; the engine (a worker
process of its own: the handles are opened there) updates from the message, and its greedy output
must then be the published model's - again after it slept, woke and took the next version.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_hf_engine_ipc import PROMPT, _greedy, _learner

from streamrl.common.codec import decode
from streamrl.common.messages import SamplingParams, WeightsPublished
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import GenerationRequest
from streamrl.torchkit.testing import build_tiny_qwen2, weights_event

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_vllm_engine_updates_over_cuda_ipc_and_sleeps_between_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamrl.rollout.engines.vllm_engine import VLLMEngine

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # the worker must be another process
    a, b = build_tiny_qwen2(tmp_path / "a", seed=0), build_tiny_qwen2(tmp_path / "b", seed=1)
    ctx = torch.multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_learner, args=(child,), daemon=True)
    proc.start()
    child.close()
    config = EngineConfig(
        type="vllm",
        model=str(a),
        dtype="float32",
        max_model_len=64,
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        sleep_between_versions=True,
    )  # type: ignore[call-arg]
    engine = VLLMEngine(config)
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    try:
        for version, folder in ((1, b), (2, a), (3, b)):
            if version == 3:
                asyncio.run(engine.sleep())
                assert engine.asleep
                asyncio.run(engine.wake())
            conn.send((str(folder), version))
            msg = decode(conn.recv_bytes(), WeightsPublished)
            asyncio.run(
                engine.update_weights(
                    weights_event(msg.version, transport="ipc", checksum=msg.checksum, ipc=msg.ipc), 30.0
                )
            )
            conn.send("taken")
            (out,) = asyncio.run(engine.generate([GenerationRequest(PROMPT, greedy)]))
            expected = _greedy(folder)
            assert engine.version == version and out[0].token_ids == expected[: len(out[0].token_ids)], folder
        assert _greedy(a) != _greedy(b), "the two models must answer differently for the test to mean anything"
    finally:
        engine.close()
        conn.send(None)
        proc.join(timeout=30)
