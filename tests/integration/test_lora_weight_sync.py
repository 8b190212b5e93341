"""Adapter-only weight sync (``learner.lora.sync = "adapter"``) into both engines, against merged weights.

A learner's LoRA policy (tiny random Qwen2, CPU) with a random adapter: its adapter alone is served
over ZMQ to an engine built from the base folder (a late joiner: base from its model path + the
current adapter), its merged weights to another; both must generate exactly the same greedy tokens,
and not what the base generates. Then what an engine refuses: a tampered adapter (checksum), an
adapter above ``max_lora_rank``, an adapter to an engine without LoRA; the engine keeps its version.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import LoraAdapter, SamplingParams
from streamrl.learner.ds_config import DeepSpeedConfig, LoraConfig
from streamrl.learner.engine import ModelEngine
from streamrl.learner.rl.adapter import adapter_shape, iter_adapter
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import Engine, GenerationRequest
from streamrl.rollout.engines.factory import build_engine
from streamrl.torchkit.testing import build_tiny_qwen2, weights_event
from streamrl.torchkit.weights.zmq import ZmqPublisher

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
PROMPTS = [[11, 12, 13, 14], [40, 41, 7], [5, 99, 23, 61, 8, 3]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
RANK = 8


class Served:
    """The learner's side: one LoRA policy, its adapter and its merged weights each on a weight server."""

    def __init__(self, model: Path) -> None:
        ds = DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant")
        engine = ModelEngine.from_config(str(model), ds, lora=LoraConfig(rank=RANK, alpha=16.0), train=False)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():  # a trained-looking adapter: B is zero at init, which would change nothing
            for name, p in engine.module.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        self.shape = adapter_shape(engine.module)
        self.adapter_tensors = list(iter_adapter(engine.module, 0))
        self.adapter = ZmqPublisher(tied_aliases={})
        adapter = self.adapter.publish(self.adapter_tensors, 1)
        self.adapter_checksum, self.adapter_bytes = adapter["checksum"], adapter["num_bytes"]
        self.merged_tensors = list(engine.iter_full_params())
        self.merged = ZmqPublisher()
        merged = self.merged.publish(self.merged_tensors, 1)
        self.merged_checksum, self.merged_bytes = merged["checksum"], merged["num_bytes"]

    def close(self) -> None:
        self.adapter.close()
        self.merged.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("lora") / "base", seed=0)


@pytest.fixture(scope="module")
def served(model: Path) -> Iterator[Served]:
    s = Served(model)
    yield s
    s.close()


def _engine(kind: str, model: Path, max_lora_rank: int | None) -> Engine:
    return build_engine(
        EngineConfig(
            type=kind,  # type: ignore[arg-type]
            model=str(model),
            dtype="float32",
            max_model_len=128,
            kv_cache_gib=0.25,
            enforce_eager=True,
            device="cpu",
            max_lora_rank=max_lora_rank,
        )
    )


def _greedy(engine: Engine) -> list[list[int]]:
    results = asyncio.run(engine.generate([GenerationRequest(p, GREEDY) for p in PROMPTS]))
    return [samples[0].token_ids for samples in results]


@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_adapter_sync_generates_exactly_what_merged_weights_generate(
    kind: str, model: Path, served: Served, tmp_path: Path
) -> None:
    assert all(".lora_" in name for name, _ in served.adapter_tensors)
    assert served.adapter_bytes == sum(t.numel() * t.element_size() for _, t in served.adapter_tensors)
    print(f"{kind}: adapter {served.adapter_bytes} bytes, merged weights {served.merged_bytes} bytes")

    merged = _engine(kind, model, max_lora_rank=None)
    try:
        base = _greedy(merged)
        asyncio.run(
            merged.update_weights(
                weights_event(1, endpoint=served.merged.endpoint, checksum=served.merged_checksum), 30
            )
        )
        expected = _greedy(merged)
    finally:
        merged.close()
    assert expected != base, "the adapter must change the greedy tokens for this test to mean anything"

    lora = _engine(kind, model, max_lora_rank=RANK)  # a late joiner: the base from its folder, then the adapter
    try:
        assert _greedy(lora) == base
        endpoint, checksum = served.adapter.endpoint, served.adapter_checksum
        with pytest.raises(WeightSyncError, match="checksum mismatch"):  # a tampered adapter: nothing applied
            asyncio.run(
                lora.update_weights(
                    weights_event(1, endpoint=endpoint, checksum="f" * 64, payload="lora", lora=served.shape), 30
                )
            )
        assert lora.version == 0 and _greedy(lora) == base
        above = LoraAdapter(rank=RANK * 2, alpha=32.0, target_modules=served.shape.target_modules)
        with pytest.raises(WeightSyncError, match=r"above rollout\.engine\.max_lora_rank"):
            asyncio.run(
                lora.update_weights(
                    weights_event(1, endpoint=endpoint, checksum=checksum, payload="lora", lora=above), 30
                )
            )
        asyncio.run(
            lora.update_weights(
                weights_event(1, endpoint=endpoint, checksum=checksum, payload="lora", lora=served.shape), 30
            )
        )
        assert lora.version == 1
        assert _greedy(lora) == expected
        # full weights after adapters (a learner restarted with lora.sync = "merged"): no adapter on top of them
        merged_again = ZmqPublisher()
        try:
            published = merged_again.publish(served.merged_tensors, 2)
            checksum2 = published["checksum"]
            asyncio.run(lora.update_weights(weights_event(2, endpoint=merged_again.endpoint, checksum=checksum2), 30))
        finally:
            merged_again.close()
        assert lora.version == 2
        assert _greedy(lora) == expected, "the adapter was applied on top of merged weights"
    finally:
        lora.close()


@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_an_engine_without_lora_refuses_an_adapter(kind: str, model: Path, served: Served) -> None:
    engine = _engine(kind, model, max_lora_rank=None)
    try:
        with pytest.raises(WeightSyncError, match=r"set rollout\.engine\.max_lora_rank"):
            asyncio.run(
                engine.update_weights(
                    weights_event(
                        1,
                        endpoint=served.adapter.endpoint,
                        checksum=served.adapter_checksum,
                        payload="lora",
                        lora=served.shape,
                    ),
                    30,
                )
            )
        assert engine.version == 0
    finally:
        engine.close()
