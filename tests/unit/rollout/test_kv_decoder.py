"""The KV decoder reproduces the model's own forward (Llama, Qwen2 with GQA + tied head, Qwen3 with
q/k norms), across prompts of different lengths, decode steps and slot moves; other models are refused.
The CUDA-graph path is checked against eager decoding on a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

from streamrl.rollout.engines.kv_decoder import KVDecoder, unsupported_reason

CONFIGS = {
    "llama": LlamaConfig(
        vocab_size=200,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
    "qwen2": Qwen2Config(
        vocab_size=200,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
    "qwen3": Qwen3Config(
        vocab_size=200,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
}


def _model(kind: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[kind]).to(device=device, dtype=dtype).eval()


def _reference(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens], device=model.device)).logits[0].float()


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_prefill_and_decode_equal_the_models_forward(kind: str) -> None:
    model = _model(kind)
    decoder = KVDecoder(model, max_slots=8, max_len=64, cuda_graphs=False)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (7, 2, 4)]
    # 5 slots: prompt 0 twice (slots 0, 3), prompt 1 (slot 1), prompt 2 twice (slots 2, 4)
    source = torch.tensor([0, 1, 2, 0, 2])
    follow = torch.randint(0, 200, (5, 6), generator=gen)
    with torch.inference_mode():
        decoder.reserve(5, 20)
        first = decoder.prefill(prompts, torch.arange(5), source)
        steps = []
        for t in range(6):
            pos = torch.tensor([len(prompts[int(s)]) + t for s in source])
            steps.append(decoder.decode(follow[:, t], pos, int(pos.max())))
    for slot, s in enumerate(source.tolist()):
        ref = _reference(model, prompts[s] + follow[slot].tolist())[len(prompts[s]) - 1 :]
        got = torch.stack([first[slot]] + [step[slot] for step in steps])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_moved_slots_and_a_grown_cache_keep_their_sequences() -> None:
    model = _model("qwen2")
    decoder = KVDecoder(model, max_slots=16, max_len=512, cuda_graphs=False)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    with torch.inference_mode():
        decoder.reserve(2, 8)
        decoder.prefill(prompts, torch.arange(2), torch.arange(2))
        decoder.reserve(9, 300)  # re-allocates: K/V of slots 0-1 must survive
        decoder.move(torch.tensor([1]), torch.tensor([7]), decoder.capacity)
        got = decoder.decode(torch.tensor([42] * 8), torch.tensor([3, 0, 0, 0, 0, 0, 0, 5]), 5)
    torch.testing.assert_close(got[0], _reference(model, [5, 6, 7, 42])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[7], _reference(model, [9, 10, 11, 12, 13, 42])[-1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="exceed"):
        decoder.reserve(17, 10)


def test_a_released_cache_frees_its_memory_and_is_reserved_again_at_the_next_batch() -> None:
    """The transformers engine's sleep (``sleep_between_versions``): the KV cache goes, and the next
    batch decodes exactly as before it."""
    model = _model("qwen2")
    decoder = KVDecoder(model, max_slots=4, max_len=64, cuda_graphs=False)
    prompt = [5, 6, 7]
    with torch.inference_mode():
        decoder.reserve(1, 8)
        decoder.prefill([prompt], torch.arange(1), torch.arange(1))
        assert decoder.cache_bytes > 0
        decoder.release()
        assert (decoder.cache_bytes, decoder.slots, decoder.capacity) == (0, 0, 0)
        decoder.reserve(1, 8)
        first = decoder.prefill([prompt], torch.arange(1), torch.arange(1))
        step = decoder.decode(torch.tensor([42]), torch.tensor([3]), 3)
    ref = _reference(model, [*prompt, 42])
    torch.testing.assert_close(first[0], ref[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step[0], ref[3], atol=1e-4, rtol=1e-4)


def test_other_architectures_are_refused_with_a_reason() -> None:
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=100, n_embd=64, n_layer=1, n_head=2))
    assert "gpt2" in (unsupported_reason(gpt2) or "")
    sliding = Qwen2Config(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=0,
    )
    assert "sliding" in (unsupported_reason(AutoModelForCausalLM.from_config(sliding)) or "")
    with pytest.raises(ValueError, match="gpt2"):
        KVDecoder(gpt2, 4, 32, cuda_graphs=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decoding_equals_eager_decoding() -> None:
    model = _model("qwen2", "cuda", torch.bfloat16)
    outputs = []
    for graphs in (False, True):
        decoder = KVDecoder(model, max_slots=64, max_len=512, cuda_graphs=graphs)
        ids = torch.arange(1, 38, device="cuda")
        with torch.inference_mode():
            decoder.reserve(37, 300)
            decoder.prefill([[3, 4, 5, 6]], torch.arange(37), torch.zeros(37, dtype=torch.long))
            logits = [decoder.decode(ids, torch.full((37,), 4 + t, device="cuda"), 4 + t) for t in range(150)]
        outputs.append(torch.stack(logits))
    assert (64, 256) in decoder._graphs and (64, 128) in decoder._graphs
    torch.testing.assert_close(outputs[1], outputs[0], atol=0, rtol=0)
