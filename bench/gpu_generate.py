"""GPU benchmark part (a): the transformers rollout engine against plain ``model.generate``.

Both sides generate for the same batch in the same process on the same GPU: ``prompts`` random
prompts (lengths spread over ``prompt_len/2 .. prompt_len`` tokens) x ``samples`` samples x exactly
``new_tokens`` new tokens (``min_new_tokens = max_new_tokens`` on both sides, so an early EOS of the
random model cannot shorten one side), temperature 1, bf16, a Qwen2-0.5B-shaped random model.

* ``generate``: ``model.generate(do_sample=True)`` on the left-padded batch of all samples (each
  prompt repeated ``samples`` times), timed warm (a first, untimed call compiles nothing but warms
  the allocator and kernels); and the same with ``cache_implementation="static"``.
* ``engine``: :class:`streamrl.rollout.engines.hf_engine.HFEngine` (KV decoder, CUDA graphs) answering one
  ``generate`` call of ``prompts`` requests with ``n = samples``, timed warm (the first call
  captures its CUDA graphs) — engine start-up and graph capture are reported separately.

    python bench/gpu_generate.py [--prompts 64] [--samples 8] [--new-tokens 256] [--tiny]

``--tiny`` runs a small model on the CPU (a check of this script, not a measurement). Prints one
JSON object last. ``run(args) -> dict`` for bench/gpu.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for src in ("libs/common/src", "services/rollout/src"):
    if str(ROOT / src) not in sys.path:
        sys.path.insert(0, str(ROOT / src))

QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=384,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per side (the best is reported too)")
    parser.add_argument("--tiny", action="store_true", help="small model on the CPU: checks the script only")


def _build_model(folder: Path, tiny: bool, shape: dict[str, Any] | None = None, device: str = "cpu") -> None:
    """A random Qwen2 of the chosen shape (``shape``: Qwen2Config fields; default TINY or QWEN2_05B)
    with a byte-level tokenizer (ids past its vocabulary decode to ''), bf16 (float32 when ``tiny``),
    initialised on ``device`` (another device draws other random weights)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from streamrl.torchkit.testing import build_tokenizer

    _, eos = build_tokenizer(folder)
    config = Qwen2Config(**(shape or (TINY if tiny else QWEN2_05B)), eos_token_id=eos, bos_token_id=eos)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.float32 if tiny else torch.bfloat16)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)


def _prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(max(1, length // 2), length + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, min(vocab, 380), (n,), generator=gen).tolist() for n in lengths]


def _time_generate(model: Any, prompts: list[list[int]], samples: int, new_tokens: int, pad: int, **kw: Any) -> float:
    import torch

    rows = [p for p in prompts for _ in range(samples)]
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    _sync(model.device)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad,
        **kw,
    )
    _sync(model.device)
    seconds = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens, out.shape
    return seconds


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.common.messages import SamplingParams
    from streamrl.rollout.engines.config import EngineConfig
    from streamrl.rollout.engines.engine import GenerationRequest
    from streamrl.rollout.engines.hf_engine import HFEngine

    tiny = args.tiny
    if not tiny and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_generate.py needs a CUDA GPU (or --tiny for a CPU check)")
    device = "cpu" if tiny else "cuda"
    dtype = "float32" if tiny else "bfloat16"
    total = args.prompts * args.samples * args.new_tokens
    result: dict[str, Any] = {
        "part": "a",
        "model": "tiny Qwen2 (CPU check)" if tiny else "Qwen2-0.5B-shaped, random, bf16",
        "prompts": args.prompts,
        "samples": args.samples,
        "new_tokens": args.new_tokens,
        "prompt_len": [args.prompt_len // 2, args.prompt_len],
        "generated_tokens": total,
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        _build_model(folder, tiny)
        prompts = _prompts(args.prompts, args.prompt_len, 384)

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
        pad = int(model.generation_config.eos_token_id)
        _time_generate(model, prompts, args.samples, args.new_tokens, pad)  # warm-up
        plain = [_time_generate(model, prompts, args.samples, args.new_tokens, pad) for _ in range(args.repeats)]
        static: list[float] = []
        if not tiny:
            _time_generate(model, prompts, args.samples, args.new_tokens, pad, cache_implementation="static")
            static = [
                _time_generate(model, prompts, args.samples, args.new_tokens, pad, cache_implementation="static")
                for _ in range(args.repeats)
            ]
        del model
        if not tiny:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

        started = time.perf_counter()
        engine = HFEngine(
            EngineConfig(
                type="hf",
                model=str(folder),
                dtype=dtype,
                device=device,  # type: ignore[arg-type]
                max_num_seqs=args.prompts * args.samples,
                max_model_len=args.prompt_len + args.new_tokens + 8,
            )
        )
        start_s = time.perf_counter() - started
        sampling = SamplingParams(
            temperature=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, n=args.samples
        )
        requests = [GenerationRequest(p, sampling) for p in prompts]

        def timed() -> float:
            t0 = time.perf_counter()
            out = asyncio.run(engine.generate(requests))
            seconds = time.perf_counter() - t0
            assert sum(len(s.token_ids) for group in out for s in group) == total
            return seconds

        try:
            first = timed()  # captures the CUDA graphs
            warm = [timed() for _ in range(args.repeats)]
            result["engine_uses_kv_decoder"] = engine._decoder is not None
        finally:
            engine.close()
        if not tiny:
            result["engine_peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)

    med = sorted(warm)[len(warm) // 2]
    result.update(
        engine_start_s=round(start_s, 2),
        engine_first_call_s=round(first, 3),
        engine_s=[round(s, 3) for s in warm],
        engine_tok_s=round(total / med),
        engine_tok_s_best=round(total / min(warm)),
        generate_s=[round(s, 3) for s in plain],
        generate_tok_s=round(total / sorted(plain)[len(plain) // 2]),
    )
    if static:
        result.update(
            generate_static_s=[round(s, 3) for s in static],
            generate_static_tok_s=round(total / sorted(static)[len(static) // 2]),
        )
    result["speedup_vs_generate"] = round(result["engine_tok_s"] / result["generate_tok_s"], 2)
    result["target"] = ">= 2x generate (warm)"
    result["met"] = result["speedup_vs_generate"] >= 2.0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
