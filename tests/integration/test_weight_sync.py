"""Learner ZmqPublisher -> rollout VLLMEngine over ZMQ, on a tiny random Qwen2 (CPU vLLM).

Model A is what the engine starts from; model B (another seed) is what the learner publishes.
One engine is shared by the module; tests run in file order (A, then B as version 1, ...).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import SamplingParams
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import Engine, GenerationRequest, Sample
from streamrl.rollout.engines.factory import build_engine
from streamrl.torchkit.testing import build_tiny_qwen2, weights_event
from streamrl.torchkit.weights.zmq import ZmqPublisher

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
PROMPT = [11, 12, 13, 14]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel, PreTrainedModel]:
    root = tmp_path_factory.mktemp("tiny")
    a = build_tiny_qwen2(root / "a", seed=0)
    b = build_tiny_qwen2(root / "b", seed=1)
    return a, AutoModelForCausalLM.from_pretrained(a).eval(), AutoModelForCausalLM.from_pretrained(b).eval()


@pytest.fixture(scope="module", params=[True, False], ids=["packed", "in_place"])
def engine(request: pytest.FixtureRequest, models: tuple[Path, PreTrainedModel, PreTrainedModel]) -> Iterator[Engine]:
    """cpu_weight_packing on (vLLM reloads and repacks) and off (updates copy into live weights)."""
    config = EngineConfig(
        type="vllm",
        model=str(models[0]),
        dtype="float32",
        max_model_len=320,
        kv_cache_gib=0.25,
        enforce_eager=True,
        cpu_weight_packing=request.param,
    )
    eng = build_engine(config)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ZmqPublisher]:
    """One per engine (versions start again for each)."""
    srv = ZmqPublisher(bucket_bytes=256 * 1024)  # several buckets even for the tiny model
    yield srv
    srv.close()


def _greedy(engine: Engine, prompt: list[int] = PROMPT, sampling: SamplingParams = GREEDY) -> list[int]:
    (samples,) = asyncio.run(engine.generate([GenerationRequest(prompt, sampling)]))
    return samples[0].token_ids


def _hf_greedy(model: PreTrainedModel, num_tokens: int = GREEDY.max_new_tokens) -> list[int]:
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=num_tokens, do_sample=False)
    return out[0, len(PROMPT) :].tolist()  # type: ignore[no-any-return]


def _prefix_equal(engine_tokens: list[int], hf_tokens: list[int]) -> bool:
    # transformers stops at EOS too, so equal up to the shorter one and same length unless EOS.
    return len(engine_tokens) > 0 and engine_tokens == hf_tokens[: len(engine_tokens)]


def test_update_serves_new_weights(
    engine: Engine, models: tuple[Path, PreTrainedModel, PreTrainedModel], server: ZmqPublisher
) -> None:
    _, model_a, model_b = models
    before = _greedy(engine)
    assert _prefix_equal(before, _hf_greedy(model_a))
    expected_b = _hf_greedy(model_b)
    assert expected_b[:8] != before[:8], "the two random models must disagree for this test to mean anything"

    # Tied embeddings: the learner's named_parameters() lack lm_head.weight; the server adds it.
    named = list(model_b.named_parameters())
    assert "lm_head.weight" not in dict(named)
    published = server.publish(named, version=1)
    checksum, num_bytes, num_buckets = published["checksum"], published["num_bytes"], published["num_buckets"]
    assert num_buckets > 1 and num_bytes >= sum(p.numel() * 4 for _, p in named)
    start = time.perf_counter()
    asyncio.run(engine.update_weights(weights_event(1, endpoint=server.endpoint, checksum=checksum), 10))
    elapsed = time.perf_counter() - start
    assert engine.version == 1
    (samples,) = asyncio.run(engine.generate([GenerationRequest(PROMPT, GREEDY)]))
    assert _prefix_equal(samples[0].token_ids, expected_b)
    assert (samples[0].version_start, samples[0].version_end) == (1, 1)
    print(f"weight sync of the tiny model: {elapsed * 1000:.1f} ms")


def test_bad_checksum_keeps_serving_old_weights(engine: Engine, server: ZmqPublisher) -> None:
    served = _greedy(engine)
    start = time.perf_counter()
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        asyncio.run(
            engine.update_weights(weights_event(server.version, endpoint=server.endpoint, checksum="f" * 64), 5)
        )
    assert time.perf_counter() - start < 5
    assert engine.version == 1
    assert _greedy(engine) == served


def test_unreachable_endpoint_fails_within_deadline(engine: Engine) -> None:
    start = time.perf_counter()
    with pytest.raises(WeightSyncError, match="deadline"):
        asyncio.run(engine.update_weights(weights_event(2, endpoint="tcp://127.0.0.1:9", checksum="0" * 64), 1.0))
    assert time.perf_counter() - start < 3.0
    assert engine.version == 1


def test_stale_version_is_refused(engine: Engine, server: ZmqPublisher) -> None:
    with pytest.raises(WeightSyncError, match="current version: 1"):
        asyncio.run(engine.update_weights(weights_event(0, endpoint=server.endpoint, checksum="0" * 64), 5))


LONG = SamplingParams(temperature=0, max_new_tokens=280)


def _greedy_under(model: PreTrainedModel, tokens: list[int]) -> list[int]:
    """The argmax of ``model`` at each response position of PROMPT + tokens (teacher forcing)."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits
    return logits[0, len(PROMPT) - 1 : -1].argmax(-1).tolist()  # type: ignore[no-any-return]


def test_update_waits_for_running_requests(
    engine: Engine, models: tuple[Path, PreTrainedModel, PreTrainedModel], server: ZmqPublisher
) -> None:
    """Default (no partial rollout): an update that arrives while a long generation runs lands
    after it finishes; the running sample is all old weights, and a request submitted after the
    update waits for it and is all new weights."""
    _, model_a, model_b = models
    published = server.publish(model_a.state_dict().items(), version=2)  # B -> A at version 2
    checksum = published["checksum"]
    finished: dict[str, float] = {}

    async def timed(name: str, coro: Any) -> Any:
        result = await coro
        finished[name] = time.perf_counter()
        return result

    async def update_while_generating() -> tuple[list[Any], list[Any]]:
        running = asyncio.create_task(timed("running", engine.generate([GenerationRequest(PROMPT, LONG)])))
        await asyncio.sleep(0.3)
        assert not running.done(), "generation finished before the update could land; make it longer"
        update = asyncio.create_task(
            timed("update", engine.update_weights(weights_event(2, endpoint=server.endpoint, checksum=checksum), 10))
        )
        await asyncio.sleep(0.05)
        after = asyncio.create_task(timed("after", engine.generate([GenerationRequest(PROMPT, GREEDY)])))
        (old,), (new,), _ = await asyncio.gather(running, after, update)
        return old, new

    old, new = asyncio.run(update_while_generating())
    assert finished["running"] <= finished["update"] <= finished["after"]
    assert (old[0].version_start, old[0].version_end, old[0].versions) == (1, 1, [])
    assert old[0].token_ids == _greedy_under(model_b, old[0].token_ids), "the running sample saw new weights"
    assert (new[0].version_start, new[0].version_end) == (2, 2)
    assert _prefix_equal(new[0].token_ids, _hf_greedy(model_a))
    assert engine.version == 2


def test_request_cancelled_behind_a_waiting_update_is_dropped(
    engine: Engine, models: tuple[Path, PreTrainedModel, PreTrainedModel], server: ZmqPublisher
) -> None:
    """A request held behind a waiting update and then cancelled never runs; the update and the
    running request complete, and the engine serves the new weights."""
    _, _, model_b = models
    published = server.publish(model_b.state_dict().items(), version=3)  # A -> B at version 3
    checksum = published["checksum"]

    async def scenario() -> tuple[Sample, Sample]:
        running = asyncio.create_task(engine.generate([GenerationRequest(PROMPT, LONG)]))
        await asyncio.sleep(0.3)
        assert not running.done(), "generation finished before the update could land; make it longer"
        update = asyncio.create_task(
            engine.update_weights(weights_event(3, endpoint=server.endpoint, checksum=checksum), 10)
        )
        await asyncio.sleep(0.05)
        held = asyncio.create_task(engine.generate([GenerationRequest(PROMPT, GREEDY)]))
        await asyncio.sleep(0.05)
        held.cancel()
        await update
        ((old,),) = await running
        with pytest.raises(asyncio.CancelledError):
            await held
        ((after,),) = await engine.generate([GenerationRequest(PROMPT, GREEDY)])
        return old, after

    old, after = asyncio.run(scenario())
    assert (old.version_start, old.version_end) == (2, 2)
    assert (after.version_start, after.version_end) == (3, 3)
    assert _prefix_equal(after.token_ids, _hf_greedy(model_b))


def test_partial_rollout_update_mid_generation_records_both_versions(
    models: tuple[Path, PreTrainedModel, PreTrainedModel],
) -> None:
    """partial_rollout: an update lands while a long generation runs: tokens before it follow the
    old weights, tokens after it the new ones (KV cache recomputed: their log-probs are model B's
    over the whole sequence), and the sample records the version of each token."""
    path_a, model_a, model_b = models
    config = EngineConfig(
        type="vllm",
        model=str(path_a),
        dtype="float32",
        max_model_len=320,
        kv_cache_gib=0.25,
        enforce_eager=True,
        partial_rollout=True,
    )
    partial = build_engine(config)
    server = ZmqPublisher()
    try:
        published = server.publish(model_b.state_dict().items(), version=3)  # A -> B at version 3
        checksum = published["checksum"]

        async def update_while_generating() -> Sample:
            task = asyncio.create_task(partial.generate([GenerationRequest(PROMPT, LONG)]))
            await asyncio.sleep(0.3)
            assert not task.done(), "generation finished before the update could land; make it longer"
            await partial.update_weights(weights_event(3, endpoint=server.endpoint, checksum=checksum), 10)
            assert not task.done(), "the update waited for the running request"
            (samples,) = await task
            sample = samples[0]
            assert (sample.version_start, sample.version_end) == (0, 3)
            return sample

        sample = asyncio.run(update_while_generating())
    finally:
        partial.close()
        server.close()
    tokens = sample.token_ids
    argmax_a, argmax_b = _greedy_under(model_a, tokens), _greedy_under(model_b, tokens)
    # Some switch point k: tokens[:k] greedy under A (version 0), tokens[k:] greedy under B.
    switch_points = [k for k in range(1, len(tokens)) if tokens[:k] == argmax_a[:k] and tokens[k:] == argmax_b[k:]]
    assert switch_points, "tokens are not 'old weights, then new weights'"
    assert len(sample.versions) == 2 and sample.versions[0] == (0, 0) and sample.versions[1][1] == 3
    switch = sample.versions[1][0]
    assert switch in switch_points, f"recorded switch {switch}, tokens say one of {switch_points}"
    with torch.no_grad():  # greedy: the raw log-softmax
        logp = {
            m: torch.log_softmax(m(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1], -1)
            for m in (model_a, model_b)
        }
    chosen = torch.tensor(tokens)[:, None]
    got = torch.tensor(sample.logprobs)
    torch.testing.assert_close(got[:switch], logp[model_a].gather(1, chosen)[:switch, 0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got[switch:], logp[model_b].gather(1, chosen)[switch:, 0], atol=1e-3, rtol=1e-3)
