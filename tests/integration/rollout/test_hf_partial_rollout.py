"""The transformers engine's weight updates while a long decode runs (tiny random Qwen2 on CPU, ZMQ weights).

With ``partial_rollout`` the update lands between two decode steps: the running sample goes on under
the new weights over the KV cache computed under the old ones, and records the version of each token.
Without it, the update waits for the running sample (one version per sample).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from streamrl.common.messages import SamplingParams
from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import GenerationRequest, Sample
from streamrl.rollout.engines.factory import build_engine
from streamrl.torchkit.testing import build_tiny_qwen2, weights_event
from streamrl.torchkit.weights.zmq import ZmqPublisher

PROMPT = [11, 12, 13, 14]
LONG = SamplingParams(temperature=0, max_new_tokens=900, min_new_tokens=900)
"""Greedy (the log-probs are the raw log-softmax) and long enough to be running when the update comes."""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel, PreTrainedModel]:
    root = tmp_path_factory.mktemp("tiny")
    a = build_tiny_qwen2(root / "a", seed=0)
    b = build_tiny_qwen2(root / "b", seed=1)
    return a, AutoModelForCausalLM.from_pretrained(a).eval(), AutoModelForCausalLM.from_pretrained(b).eval()


@pytest.fixture
def server() -> Iterator[ZmqPublisher]:
    srv = ZmqPublisher(bucket_bytes=256 * 1024)
    yield srv
    srv.close()


def _engine(path: Path, partial: bool) -> Any:
    config = EngineConfig(
        type="hf", model=str(path), dtype="float32", device="cpu", max_model_len=1024, partial_rollout=partial
    )
    return build_engine(config)


def _update_while_decoding(engine: Any, server: ZmqPublisher, model: PreTrainedModel) -> tuple[Sample, bool]:
    """Publish ``model`` as version 1 while a long greedy decode runs; the sample, and whether the
    decode was still running when the update had been applied."""
    published = server.publish(model.state_dict().items(), version=1)
    checksum = published["checksum"]

    async def scenario() -> tuple[Sample, bool]:
        task = asyncio.create_task(engine.generate([GenerationRequest(PROMPT, LONG)]))
        await asyncio.sleep(0.3)  # a few tokens in (the decode of LONG takes ~2 s on the 2-core VM)
        assert not task.done(), "generation finished before the update could land; make it longer"
        await engine.update_weights(weights_event(1, endpoint=server.endpoint, checksum=checksum), 10)
        running = not task.done()
        ((sample,),) = await task
        return sample, running

    return asyncio.run(scenario())


def _masked_logprobs(logits: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """Log-softmax with EOS at -inf (min_new_tokens covers every token of LONG)."""
    logits = logits.float().clone()
    logits[..., eos] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


def _eos_ids(model: PreTrainedModel, path: Path) -> list[int]:
    from transformers import AutoTokenizer

    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    tokenizer_eos = AutoTokenizer.from_pretrained(path).eos_token_id
    return sorted(ids | ({tokenizer_eos} if tokenizer_eos is not None else set()))


def test_partial_rollout_update_lands_between_decode_steps(
    models: tuple[Path, PreTrainedModel, PreTrainedModel], server: ZmqPublisher
) -> None:
    path, model_a, model_b = models
    engine = _engine(path, partial=True)
    try:
        start = time.perf_counter()
        sample, running = _update_while_decoding(engine, server, model_b)
        print(f"decode of {len(sample.token_ids)} tokens with an update inside: {time.perf_counter() - start:.2f} s")
        assert engine.version == 1
    finally:
        engine.close()
    assert running, "the update waited for the running decode"
    _check_switch(sample, model_a, model_b, _eos_ids(model_a, path))


def _check_switch(sample: Sample, model_a: PreTrainedModel, model_b: PreTrainedModel, eos: list[int]) -> None:
    """One switch from version 0 (model A) to 1 (model B) inside the response; each token's log-prob
    is that of the model its version names, the tokens after the switch over A's KV cache."""
    tokens, n = sample.token_ids, len(sample.token_ids)
    assert n == LONG.max_new_tokens
    assert (sample.version_start, sample.version_end) == (0, 1)
    assert len(sample.versions) == 2 and sample.versions[0] == (0, 0) and sample.versions[1][1] == 1
    switch = sample.versions[1][0]
    assert 1 < switch < n - 1, f"the switch at token {switch} of {n} is not inside the response"
    got = torch.tensor(sample.logprobs)
    with torch.no_grad():
        # Tokens before the switch: model A over the whole prefix.
        ids = torch.tensor([PROMPT + tokens])
        old = _masked_logprobs(model_a(ids).logits[0, len(PROMPT) - 1 : -1], eos)
        old_chosen = old.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(got[:switch], old_chosen[:switch], atol=1e-4, rtol=1e-4)
        # Tokens from the switch on: model B, over the KV cache model A computed for the positions
        # fed before the update (the prompt and the response up to token switch - 2).
        cache = DynamicCache()
        prefix = PROMPT + tokens[: switch - 1]
        model_a(torch.tensor([prefix]), past_key_values=cache, use_cache=True)
        rest = torch.tensor([tokens[switch - 1 : -1]])
        positions = torch.arange(len(prefix), len(prefix) + rest.shape[1])[None]
        logits = model_b(rest, past_key_values=cache, position_ids=positions, use_cache=True).logits[0]
        new = _masked_logprobs(logits, eos)
    new_chosen = new.gather(1, torch.tensor(tokens[switch:])[:, None])[:, 0]
    torch.testing.assert_close(got[switch:], new_chosen, atol=1e-4, rtol=1e-4)
    assert tokens[switch:] == new.argmax(-1).tolist(), "greedy tokens after the switch follow the new weights"
    assert (got[switch:] - old_chosen[switch:]).abs().max() > 1e-2, "the new weights changed nothing"


def test_partial_rollout_on_the_plain_forward(tmp_path: Path, server: ZmqPublisher) -> None:
    """Architectures without the KV decoder (GPT-2 here): the update lands between two steps of the
    model's own forward, its cache kept."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer_dir = build_tiny_qwen2(tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    gpt2 = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=2, n_positions=1024)
        gpt2.append(GPT2LMHeadModel(config).eval())
        gpt2[-1].generation_config.eos_token_id = tokenizer.eos_token_id
    gpt2[0].save_pretrained(tmp_path / "a")
    tokenizer.save_pretrained(tmp_path / "a")
    engine = _engine(tmp_path / "a", partial=True)
    try:
        assert engine._decoder is None, "GPT-2 must run on the plain forward for this test"
        sample, running = _update_while_decoding(engine, server, gpt2[1])
    finally:
        engine.close()
    assert running, "the update waited for the running decode"
    _check_switch(sample, gpt2[0], gpt2[1], _eos_ids(gpt2[0], tmp_path / "a"))


def test_without_partial_rollout_the_update_waits_for_the_decode(
    models: tuple[Path, PreTrainedModel, PreTrainedModel], server: ZmqPublisher
) -> None:
    path, model_a, model_b = models
    engine = _engine(path, partial=False)
    try:
        sample, _ = _update_while_decoding(engine, server, model_b)
        assert engine.version == 1
    finally:
        engine.close()
    # issued while it ran (checked), the update waited: every token from version 0, all model A's
    assert (sample.version_start, sample.version_end, sample.versions) == (0, 0, [])
    with torch.no_grad():
        logits = model_a(torch.tensor([PROMPT + sample.token_ids])).logits[0, len(PROMPT) - 1 : -1]
    old = _masked_logprobs(logits, _eos_ids(model_a, path))
    chosen = old.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(sample.logprobs), chosen, atol=1e-4, rtol=1e-4)
