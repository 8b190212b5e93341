"""The transformers engine on a GPU takes a LoRA adapter version over CUDA IPC (skipped without CUDA).

A spawned process plays the LoRA learner: a peft model on the GPU with a random adapter, its adapter
tensors alone published with ``IpcPublisher`` (no tied head: an adapter has none) in a
``payload = "lora"`` event. The engine, built from the base folder, takes two versions; after each its
greedy output is the merged model's; a version whose buffers changed since the event (another checksum)
is refused and the version before is still served.
"""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import pytest
import torch

from streamrl.common.codec import decode, encode
from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import SamplingParams, WeightsPublished
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import GenerationRequest
from streamrl.rollout.engines.factory import build_engine
from streamrl.torchkit.testing import build_tiny_qwen2, weights_event

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPT = [5, 6, 7, 8, 9]
RANK = 8


def _learner(conn: Connection, folder: str) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    from streamrl.learner.ds_config import LoraConfig
    from streamrl.learner.rl.adapter import adapter_shape, iter_adapter
    from streamrl.torchkit.weights.ipc import IpcPublisher

    base = AutoModelForCausalLM.from_pretrained(folder).cuda()
    lora = LoraConfig(rank=RANK, alpha=16.0)
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules)  # type: ignore[arg-type]
    model = peft.get_peft_model(base, config).eval()
    publisher = IpcPublisher(bucket_bytes=2**20, tied_aliases={})
    while (version := conn.recv()) is not None:
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        published = publisher.publish(iter_adapter(model, 0), version)
        ipc, checksum = published["ipc"], published["checksum"]
        with torch.no_grad():
            ids = torch.tensor([PROMPT], device="cuda")
            with model.disable_adapter():
                plain = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)[0, 5:].tolist()
            model.merge_adapter()
            merged = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)[0, 5:].tolist()
            model.unmerge_adapter()
        event = WeightsPublished(
            version=version,
            step=version,
            batch_id="",
            checksum=checksum,
            num_bytes=publisher.num_bytes,
            num_buckets=publisher.num_buffers,
            endpoint="",
            transport="ipc",
            ipc=ipc,
            payload="lora",
            lora=adapter_shape(model),
        )
        conn.send((encode(event), plain, merged))
        conn.recv()  # keep the buffers alive until the engine took them


def test_engine_takes_lora_adapters_over_cuda_ipc(tmp_path: Path) -> None:
    folder = build_tiny_qwen2(tmp_path / "base", seed=0)
    ctx = torch.multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_learner, args=(child, str(folder)), daemon=True)
    proc.start()
    child.close()
    engine = build_engine(
        EngineConfig(type="hf", model=str(folder), dtype="float32", device="cuda", max_model_len=64, max_lora_rank=RANK)
    )
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    try:
        for version in (1, 2):
            conn.send(version)
            data, plain, merged = conn.recv()
            msg = decode(data, WeightsPublished)
            assert msg.ipc is not None and all(".lora_" in t.name for t in msg.ipc.tensors), "adapter tensors only"
            if version == 2:  # tampered: the buffers hold other bytes than the signed checksum says
                with pytest.raises(WeightSyncError, match="checksum"):
                    bad = msgspec.structs.replace(msg, checksum="v2:0:0")
                    asyncio.run(
                        engine.update_weights(
                            weights_event(
                                2, transport="ipc", checksum=bad.checksum, ipc=bad.ipc, payload="lora", lora=bad.lora
                            ),
                            5.0,
                        )
                    )
                assert engine.version == 1
            asyncio.run(
                engine.update_weights(
                    weights_event(
                        msg.version, transport="ipc", checksum=msg.checksum, ipc=msg.ipc, payload="lora", lora=msg.lora
                    ),
                    5.0,
                )
            )
            conn.send("taken")
            (out,) = asyncio.run(engine.generate([GenerationRequest(PROMPT, greedy)]))
            assert merged != plain, "the adapter must change the greedy tokens for the test to mean anything"
            assert engine.version == version and out[0].token_ids == merged[: len(out[0].token_ids)], version
    finally:
        engine.close()
        conn.send(None)
        proc.join(timeout=30)
