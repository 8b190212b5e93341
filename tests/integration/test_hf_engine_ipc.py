"""The transformers engine on a GPU takes colocated weights over CUDA IPC (skipped without CUDA).

A spawned process plays the learner: it loads a model folder onto the GPU and publishes its weights
with ``IpcPublisher``. The engine (CUDA graphs on) updates from the message; its greedy output
must then be the published model's, again after a second update back to the first model (the
parameters were moved into the flat layout once and the decode graphs recaptured).
"""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from streamrl.common.codec import decode, encode
from streamrl.common.messages import SamplingParams, WeightsPublished
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import GenerationRequest
from streamrl.rollout.engines.factory import build_engine
from streamrl.torchkit.testing import build_tiny_qwen2, weights_event

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPT = [5, 6, 7, 8, 9]


def _learner(conn: Connection) -> None:
    from transformers import AutoModelForCausalLM

    from streamrl.torchkit.weights.ipc import IpcPublisher

    publisher = IpcPublisher(bucket_bytes=2**20)
    while (request := conn.recv()) is not None:
        folder, version = request
        model = AutoModelForCausalLM.from_pretrained(folder).cuda()
        published = publisher.publish(model.state_dict().items(), version)
        ipc, checksum = published["ipc"], published["checksum"]
        conn.send_bytes(
            encode(
                WeightsPublished(
                    version=version,
                    step=version,
                    batch_id="",
                    checksum=checksum,
                    num_bytes=publisher.num_bytes,
                    num_buckets=publisher.num_buffers,
                    endpoint="",
                    transport="ipc",
                    ipc=ipc,
                )
            )
        )
        conn.recv()  # keep the buffers alive until the engine took them


def _greedy(folder: Path) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).cuda().eval()
    return model.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=10, do_sample=False)[0, 5:].tolist()


def test_engine_updates_over_cuda_ipc(tmp_path: Path) -> None:
    a, b = build_tiny_qwen2(tmp_path / "a", seed=0), build_tiny_qwen2(tmp_path / "b", seed=1)
    ctx = torch.multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_learner, args=(child,), daemon=True)
    proc.start()
    child.close()
    engine = build_engine(EngineConfig(type="hf", model=str(a), dtype="float32", device="cuda", max_model_len=64))
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    try:
        for version, folder in ((1, b), (2, a)):
            conn.send((str(folder), version))
            msg = decode(conn.recv_bytes(), WeightsPublished)
            asyncio.run(
                engine.update_weights(
                    weights_event(msg.version, transport="ipc", checksum=msg.checksum, ipc=msg.ipc), 5.0
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
