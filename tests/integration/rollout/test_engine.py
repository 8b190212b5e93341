"""Generation engines on a tiny random Qwen2: behaviour log-probs, sampling semantics, interface.

One vLLM engine and one HF engine are shared by the whole module (vLLM starts in 3-16 s).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM, PreTrainedModel

from streamrl.common.aio import cancel_and_wait, timeout
from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import SamplingParams
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import Engine, GenerationRequest, Sample
from streamrl.rollout.engines.factory import build_engine
from streamrl.rollout.engines.hf_engine import HFEngine, processed_logprobs
from streamrl.torchkit.testing import build_tiny_qwen2, weights_event
from streamrl.torchkit.weights.zmq import ZmqPublisher

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return build_tiny_qwen2(root / "a", seed=0), build_tiny_qwen2(root / "b", seed=1)


@pytest.fixture(scope="module")
def hf_model(model_dirs: tuple[Path, Path]) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dirs[0]).eval()


def _config(model: Path, engine_type: str) -> EngineConfig:
    return EngineConfig(
        type=engine_type, model=str(model), dtype="float32", max_model_len=256, kv_cache_gib=0.25, enforce_eager=True
    )  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def vllm_engine(model_dirs: tuple[Path, Path]) -> Iterator[Engine]:
    engine = build_engine(_config(model_dirs[0], "vllm"))
    yield engine
    engine.close()


@pytest.fixture
def hf_engine(model_dirs: tuple[Path, Path]) -> Iterator[Engine]:
    engine = build_engine(_config(model_dirs[0], "hf"))
    assert isinstance(engine, HFEngine)
    yield engine
    engine.close()


def _reference_logprobs(
    model: PreTrainedModel, prompt: list[int], tokens: list[int], sampling: SamplingParams
) -> torch.Tensor:
    """Teacher-forced transformers log-probs of ``tokens`` under the processed distribution."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logp = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def _slow_processed_logprobs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Obviously-correct reference for one row: scale, keep top-k, keep the top-p nucleus, normalise."""
    import math

    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    kept_order = [i for i in order if i in keep]
    z = sum(math.exp(scaled[i]) for i in kept_order)
    nucleus, mass = [], 0.0
    for i in kept_order:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += math.exp(scaled[i]) / z
    z2 = sum(math.exp(scaled[i]) for i in nucleus)
    return [scaled[i] - math.log(z2) if i in nucleus else -math.inf for i in range(len(scaled))]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, -1, 1.0), (1.3, 4, 1.0), (0.9, -1, 0.6), (0.5, 5, 0.8)]
)
def test_processed_logprobs_matches_slow_reference(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(0))
    got = processed_logprobs(logits, temperature, top_k, top_p)
    for row in range(3):
        want = torch.tensor(_slow_processed_logprobs(logits[row].tolist(), temperature, top_k, top_p))
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want))
        finite = ~torch.isinf(want)
        torch.testing.assert_close(got[row][finite], want[finite].float(), atol=1e-5, rtol=0)


def test_greedy_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(2, 9)
    torch.testing.assert_close(processed_logprobs(logits, 0.0, 3, 0.5), torch.log_softmax(logits, -1))


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.7, max_new_tokens=24, n=3, seed=11),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=24, n=2, seed=5),
    ],
    ids=["T0.7", "T1-topk20-topp0.9"],
)
def test_vllm_behaviour_logprobs_match_transformers(
    vllm_engine: Engine, hf_model: PreTrainedModel, sampling: SamplingParams
) -> None:
    (samples,) = asyncio.run(vllm_engine.generate([GenerationRequest(PROMPT, sampling)]))
    assert len(samples) == sampling.n
    assert len({tuple(s.token_ids) for s in samples}) > 1, "n samples of one prompt should differ"
    for s in samples:
        assert len(s.logprobs) == len(s.token_ids) > 0
        ref = _reference_logprobs(hf_model, PROMPT, s.token_ids, sampling)
        assert torch.isfinite(ref).all(), "vLLM sampled a token outside the processed distribution's support"
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-3, rtol=0)
        assert s.finish_reason in ("stop", "length")
        assert s.truncated == (s.finish_reason == "length")
        assert (s.version_start, s.version_end) == (0, 0)


def test_vllm_concurrent_generate_calls_and_seeds(vllm_engine: Engine) -> None:
    seeded = GenerationRequest(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=7))
    other = GenerationRequest([3, 4], SamplingParams(temperature=0.8, max_new_tokens=6, n=4))

    async def together() -> list[list[list[int]]]:
        results = await asyncio.gather(*(vllm_engine.generate([seeded, other]) for _ in range(3)))
        return [[s.token_ids for s in result[0]] for result in results]

    runs = asyncio.run(together())
    assert runs[0] == runs[1] == runs[2], "the same seed must give the same samples"
    (first,) = asyncio.run(vllm_engine.generate([GenerationRequest([3, 4], SamplingParams(max_new_tokens=6, n=4))]))
    assert len(first) == 4 and all(len(s.token_ids) <= 6 for s in first)


def test_vllm_stop_string_and_length(vllm_engine: Engine, model_dirs: tuple[Path, Path]) -> None:
    (greedy,) = asyncio.run(
        vllm_engine.generate([GenerationRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=16))])
    )
    full = greedy[0]
    assert full.finish_reason == "length" and full.truncated and len(full.token_ids) == 16
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), "need a non-blank stop string from the greedy text"
    (stopped,) = asyncio.run(
        vllm_engine.generate([GenerationRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=16, stop=[stop]))])
    )
    s = stopped[0]
    assert s.finish_reason == "stop" and not s.truncated
    assert stop not in s.text and full.text.startswith(s.text)
    assert len(s.token_ids) < 16


def test_hf_engine_interface(hf_engine: Engine, hf_model: PreTrainedModel, model_dirs: tuple[Path, Path]) -> None:
    sampling = SamplingParams(temperature=0.7, top_k=30, top_p=0.95, max_new_tokens=10, n=3, seed=2)
    (samples,) = asyncio.run(hf_engine.generate([GenerationRequest(PROMPT, sampling)]))
    assert len(samples) == 3
    for s in samples:
        torch.testing.assert_close(
            torch.tensor(s.logprobs), _reference_logprobs(hf_model, PROMPT, s.token_ids, sampling)
        )
        assert s.finish_reason in ("stop", "length") and (s.version_start, s.version_end) == (0, 0)
    (again,) = asyncio.run(hf_engine.generate([GenerationRequest(PROMPT, sampling)]))
    assert [s.token_ids for s in again] == [s.token_ids for s in samples], "same seed, same samples"

    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    (out,) = asyncio.run(hf_engine.generate([GenerationRequest(PROMPT, greedy)]))
    expected = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT) :].tolist()
    assert out[0].token_ids == expected[: len(out[0].token_ids)]
    stop = out[0].text[4:7]
    (stopped,) = asyncio.run(
        hf_engine.generate([GenerationRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=12, stop=[stop]))])
    )
    assert stopped[0].finish_reason == "stop" and stop not in stopped[0].text

    # Weight update from the learner's server: greedy output becomes model B's.
    model_b = AutoModelForCausalLM.from_pretrained(model_dirs[1]).eval()
    server = ZmqPublisher(bucket_bytes=256 * 1024)
    try:
        published = server.publish(model_b.state_dict().items(), version=4)
        checksum, num_buckets = published["checksum"], published["num_buckets"]
        assert num_buckets > 1
        with pytest.raises(WeightSyncError, match="checksum"):
            asyncio.run(hf_engine.update_weights(weights_event(4, endpoint=server.endpoint, checksum="0" * 64), 5))
        assert hf_engine.version == 0
        asyncio.run(hf_engine.update_weights(weights_event(4, endpoint=server.endpoint, checksum=checksum), 5))
    finally:
        server.close()
    assert hf_engine.version == 4
    (after,) = asyncio.run(hf_engine.generate([GenerationRequest(PROMPT, greedy)]))
    expected_b = model_b.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT) :].tolist()
    assert after[0].token_ids == expected_b[: len(after[0].token_ids)] != expected[: len(after[0].token_ids)]
    assert (after[0].version_start, after[0].version_end) == (4, 4)


def test_hf_update_given_up_mid_fetch_stops_it_and_the_engine_serves_on(hf_engine: Engine) -> None:
    """The service gives a weight update up while its fetch waits on a weight server that never answers (a
    newer weights event came, or the worker is stopping): the fetch stops at once instead of at the 60 s sync
    deadline, the driver thread survives it (no InvalidStateError), generates and closes at once."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts the connection, never answers
    silent.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"

    async def scenario() -> float:
        update = asyncio.create_task(
            hf_engine.update_weights(weights_event(1, endpoint=endpoint, checksum="0" * 64), 60)
        )
        await asyncio.sleep(1.0)  # the driver thread is in the fetch
        await cancel_and_wait([update])
        started = time.monotonic()
        greedy = SamplingParams(temperature=0, max_new_tokens=4)
        async with timeout(30):
            (samples,) = await hf_engine.generate([GenerationRequest(PROMPT, greedy)])
        assert samples[0].token_ids
        return time.monotonic() - started

    try:
        generated_after_s = asyncio.run(scenario())
    finally:
        silent.close()
        ctx.term()
    assert generated_after_s < 5.0, f"generation waited {generated_after_s:.1f} s behind the abandoned fetch"
    assert hf_engine.version == 0
    started = time.monotonic()
    hf_engine.close()
    assert time.monotonic() - started < 5.0


def test_hf_engine_batches_concurrent_calls_exactly(hf_engine: Engine, hf_model: PreTrainedModel) -> None:
    """Calls submitted together are decoded together; each answer is what it would be alone."""
    short, long = [3, 4], [5, 6, 7, 8, 9, 10, 11]
    greedy = SamplingParams(temperature=0, max_new_tokens=9)
    seeded = SamplingParams(temperature=0.8, top_k=25, max_new_tokens=7, min_new_tokens=7, n=3, seed=9)
    free = SamplingParams(temperature=1.2, top_p=0.9, max_new_tokens=5, n=4)

    async def together() -> list[list[list[Sample]]]:
        calls = [
            hf_engine.generate([GenerationRequest(short, greedy), GenerationRequest(long, seeded)]),
            hf_engine.generate([GenerationRequest(long, greedy)]),
            hf_engine.generate([GenerationRequest(short, free)]),
        ]
        return list(await asyncio.gather(*calls))

    (short_greedy, long_seeded), (long_greedy,), (short_free,) = asyncio.run(together())
    for prompt, out in ((short, short_greedy), (long, long_greedy)):
        alone = hf_model.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False)[0, len(prompt) :]
        assert out[0].token_ids == alone.tolist()[: len(out[0].token_ids)]
        torch.testing.assert_close(
            torch.tensor(out[0].logprobs),
            _reference_logprobs(hf_model, prompt, out[0].token_ids, greedy),
            atol=1e-4,
            rtol=0,
        )
    assert [len(s.token_ids) for s in long_seeded] == [7, 7, 7], "min_new_tokens = max_new_tokens fixes the length"
    for sampling, prompt, samples in ((seeded, long, long_seeded), (free, short, short_free)):
        assert len(samples) == sampling.n
        for s in samples:
            ref = _reference_logprobs(hf_model, prompt, s.token_ids, sampling)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)
        assert all(len(s.token_ids) <= sampling.max_new_tokens for s in samples)
    (seeded_alone,) = asyncio.run(hf_engine.generate([GenerationRequest(long, seeded)]))
    assert [s.token_ids for s in seeded_alone] == [s.token_ids for s in long_seeded], (
        "a seed repeats whatever is batched"
    )


def test_bad_requests_are_rejected(hf_engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"sampling\.n"):
        asyncio.run(hf_engine.generate([GenerationRequest(PROMPT, SamplingParams(n=0))]))
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(hf_engine.generate([GenerationRequest(list(range(300)), SamplingParams())]))


def test_vllm_bad_prompt_and_cancel_leave_the_engine_working(vllm_engine: Engine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(vllm_engine.generate([GenerationRequest(list(range(300)), SamplingParams(max_new_tokens=4))]))
    with pytest.raises(ValueError, match="temperature"):  # refused by vLLM itself, inside the driver thread
        asyncio.run(vllm_engine.generate([GenerationRequest(PROMPT, SamplingParams(temperature=-1.0))]))

    async def cancel_a_long_generation() -> None:
        long = GenerationRequest(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=200, n=4))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(vllm_engine.generate([long]), timeout=0.05)

    asyncio.run(cancel_a_long_generation())
    (samples,) = asyncio.run(vllm_engine.generate([GenerationRequest(PROMPT, SamplingParams(max_new_tokens=5, n=2))]))
    assert [len(s.token_ids) <= 5 for s in samples] == [True, True]
    assert not vllm_engine._running, "cancelled requests must be aborted in vLLM"  # type: ignore[attr-defined]


def test_engine_options_that_cannot_work_are_refused(model_dirs: tuple[Path, Path]) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 needs type='vllm'"):
        EngineConfig(type="hf", model="m", tensor_parallel_size=2)
    # In-place updates need the engine in this process: refused before vLLM builds anything.
    config = EngineConfig(type="vllm", model=str(model_dirs[0]), tensor_parallel_size=2, cpu_weight_packing=False)
    with pytest.raises(ValueError, match="cpu_weight_packing=false needs the vLLM engine in the rollout process"):
        build_engine(config)


def test_hf_engine_refills_free_slots_and_stays_exact(model_dirs: tuple[Path, Path], hf_model: PreTrainedModel) -> None:
    """15 samples through 4 KV slots: samples of different lengths leave and waiting ones take their
    slots mid-decoding; every answer is still what the model gives alone."""
    config = _config(model_dirs[0], "hf").model_copy(update={"max_num_seqs": 4})
    engine = build_engine(config)
    assert isinstance(engine, HFEngine) and engine._decoder is not None, "the tiny Qwen2 runs on the KV decoder"
    prompts = [[3, 4], [5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
    settings = [
        SamplingParams(temperature=0, max_new_tokens=3),
        SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=20, n=3, seed=1),
        SamplingParams(temperature=1.1, top_k=40, max_new_tokens=9, n=11),
    ]
    try:
        out = asyncio.run(engine.generate([GenerationRequest(p, s) for p, s in zip(prompts, settings, strict=True)]))
    finally:
        engine.close()
    greedy = hf_model.generate(torch.tensor([prompts[0]]), max_new_tokens=3, do_sample=False)[0, 2:].tolist()
    assert out[0][0].token_ids == greedy[: len(out[0][0].token_ids)]
    assert len(out[1]) == 3 and all(len(s.token_ids) <= 20 for s in out[1])
    assert max(len(s.token_ids) for s in out[1]) > 9, "samples of different lengths shared the slots"
    assert len(out[2]) == 11 and all(len(s.token_ids) <= 9 for s in out[2])
    for prompt, sampling, samples in zip(prompts, settings, out, strict=True):
        for s in samples:
            ref = _reference_logprobs(hf_model, prompt, s.token_ids, sampling)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)


def test_hf_engine_runs_other_architectures_on_their_own_forward(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(model_dirs[0])
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=2, n_positions=256))
    gpt2.generation_config.eos_token_id = tokenizer.eos_token_id
    gpt2.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = build_engine(_config(tmp_path, "hf"))
    sampling = SamplingParams(temperature=0.8, top_k=50, max_new_tokens=8, n=2)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    try:
        assert isinstance(engine, HFEngine) and engine._decoder is None
        sampled, (argmax,) = asyncio.run(
            engine.generate([GenerationRequest(PROMPT, sampling), GenerationRequest(PROMPT, greedy)])
        )
    finally:
        engine.close()
    gpt2.eval()
    expected = gpt2.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT) :].tolist()
    assert argmax.token_ids == expected[: len(argmax.token_ids)]
    for s in sampled:
        ref = _reference_logprobs(gpt2, PROMPT, s.token_ids, sampling)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)
